"""layer_bench.py's kernel aggregation (CPU): the un-graphed call's list and --graph-profile's per-layer list of a
graph replay that holds several layer calls, and the comparison of the two."""
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import layer_bench as lb  # noqa: E402


def ev(name, start, end):
    rng = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return types.SimpleNamespace(name=name, time_range=rng)


def test_aggregate_divides_by_the_layer_calls_and_orders_by_time():
    # a graph of 2 layer calls, each: up 10 us, combine 3 us, and a kernel only the second call launched
    evs = [ev("up", 0, 10), ev("combine", 10, 13), ev("up", 20, 31), ev("combine", 31, 34.5), ev("extra", 35, 39)]
    assert lb.aggregate(evs, 2) == [("up", 10.5, 1), ("combine", 3.2, 1), ("extra", 2.0, 0.5)]
    # per = 1 is the un-graphed call's list: whole launch counts, names cut at 90 characters
    assert lb.aggregate([ev("k" * 100, 0, 1.25)]) == [("k" * 90, 1.2, 1)]


def test_graph_vs_call_names_the_kernels_that_grew_most():
    call = [("up", 250.0, 1), ("down", 150.0, 1), ("kda", 21.0, 1)]
    graph = [("up", 310.5, 1), ("down", 149.0, 1), ("kda", 21.2, 1), ("only_in_graph", 4.0, 1)]
    rows = lb.graph_vs_call(call, graph, most=3)
    assert rows == [("up", 250.0, 310.5, 60.5), ("only_in_graph", 0.0, 4.0, 4.0), ("down", 150.0, 149.0, -1.0)]


def fake_profiler(monkeypatch, events):
    """torch.profiler.profile replaced by one that returns `events` (the CPU build has no CUDA activity)."""
    class Fake:
        def __init__(self, activities):
            assert activities == [lb.torch.profiler.ProfilerActivity.CUDA]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events
    monkeypatch.setattr(lb.torch.profiler, "profile", Fake)
    monkeypatch.setattr(lb.torch.cuda, "synchronize", lambda: None)


def test_profile_graph_per_layer_kernels_and_span(monkeypatch):
    import gpu_kernels
    monkeypatch.setattr(gpu_kernels, "capture_graph", lambda fn, n: types.SimpleNamespace(replay=lambda: None))
    cuda = lb.torch.autograd.DeviceType.CUDA
    evs = [ev("up", 0, 10), ev("down", 12, 16), ev("memcpy HtoD", 16, 17), ev("up", 20, 30), ev("down", 31, 35)]
    for e in evs:
        e.device_type = cuda
    cpu_op = ev("aten::mm", 0, 40)
    cpu_op.device_type = lb.torch.autograd.DeviceType.CPU
    fake_profiler(monkeypatch, evs + [cpu_op])
    out = lb.profile_graph(lambda m, *a: None, [("copy0", ()), ("copy1", ())], rounds=1)
    assert out == {"graph_kernels": [("up", 10.0, 1), ("down", 4.0, 1)], "graph_kernel_us": 14.0,
                   "graph_span_us": 17.5, "graph_launches": 2.0, "graph_per_call": [(14, 16), (14, 15)]}


def test_profile_graph_says_so_when_the_profiler_sees_no_kernels(monkeypatch):
    """A profiler that records no kernel of a graph replay gives an error entry, not a row of zeros."""
    import gpu_kernels
    replays = []
    monkeypatch.setattr(gpu_kernels, "capture_graph",
                        lambda fn, n: types.SimpleNamespace(replay=lambda: replays.append(n)))
    fake_profiler(monkeypatch, [])
    out = lb.profile_graph(lambda m, *a: None, [("copy0", ()), ("copy1", ())], rounds=2)
    assert out == {"graph_profile_error": "no kernel events in the profiled graph replay"}
    assert replays == [4, 4]            # a warm replay, then the profiled one, of 2 copies x 2 rounds


def test_per_call_cuts_the_replay_into_its_layer_calls():
    # 2 calls of 2 kernels each, listed out of order; the second call's up is slower
    evs = [ev("up", 20, 40), ev("up", 0, 10), ev("combine", 10, 13), ev("combine", 40, 42)]
    assert lb.per_call(evs, 2) == [(13, 13), (22, 22)]
    # a launch count that does not divide: no per-call list rather than a wrong one
    assert lb.per_call(evs[:3], 2) == []


def test_routed_experts_counts_the_layers_own_routing():
    """The per-copy floor's expert count: the distinct ids the layer's router module returned in the call."""
    import torch
    from k3fuse.models import KimiK3Cache

    class Gate(torch.nn.Module):
        def forward(self, x):           # token i picks experts (3i, 3i + 1) mod 8: at M = 4 ids 0-4, 6, 7 (7 of 8)
            ids = torch.stack([torch.arange(x.shape[0]) * 3, torch.arange(x.shape[0]) * 3 + 1], 1) % 8
            return ids, torch.ones(ids.shape)

    m = torch.nn.Module()
    m.layer = torch.nn.Module()
    m.layer.mlp = torch.nn.Module()
    m.layer.mlp.gate = Gate()
    calls = []
    fn = lambda mod, x, cache: calls.append(mod.layer.mlp.gate(x))
    inp = [torch.randn(4, 16), KimiK3Cache([None], [None], [None], torch.zeros(4, dtype=torch.int64))]
    assert lb.routed_experts(fn, m, inp) == 7
    assert len(calls) == 1 and not m.layer.mlp.gate._forward_hooks     # one call, the hook removed after it
