"""k3fuse graph passes, in pipeline order (see k3fuse.pipeline.PIPELINE)."""
from .base import K3FusePass, PassContext

__all__ = ["K3FusePass", "PassContext"]
