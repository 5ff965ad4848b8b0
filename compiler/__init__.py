"""k3fuse: a torch.compile backend that turns the Kimi K3 decode step into fused, shape-tuned CuTe DSL kernels.

    torch.compile(model, backend="k3fuse", options={...})

The backend is registered through the `torch_dynamo_backends` entry point, so importing k3fuse is optional.
"""
__version__ = "0.1.0"
from .vllm_plugin import k3fuse_getattr as __getattr__  # noqa: E402  (k3fuse_vllm_pass, lazily: no vLLM import)
