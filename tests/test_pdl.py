"""Programmatic dependent launch (engine/kernels/pdl.py): where it is on, and, on a GPU of compute
capability 9.0 or later, that a CUDA graph of the decode step's kernels launched with it gives the
bits of the same kernels launched plainly and run eagerly."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.kernels import pdl

hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a GPU of compute capability 9.0 or later (run on the lent H100/H200)")


def test_off_on_a_cpu_and_outside_its_context() -> None:
    assert not pdl.supported("cpu") and not pdl.supported(None)
    assert not pdl.active() and pdl.flags() == {"PDL": False}
    with pdl.dependent_launches("cpu"):
        assert not pdl.active() and pdl.flags() == {"PDL": False}


def test_supported_only_on_an_nvidia_gpu_of_capability_9_with_a_triton_that_has_it(monkeypatch) -> None:
    # a Hopper GPU as torch reports one, on any machine (unit test of the one function)
    monkeypatch.setattr(pdl, "triton", object())
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.supported("cuda:0") and pdl.supported(torch.device("cuda")) and not pdl.supported("cpu")
    monkeypatch.setenv("TANDEM_PDL", "0")  # the operator's switch
    assert not pdl.supported("cuda:0")
    monkeypatch.setenv("TANDEM_PDL", "1")
    for on in ("1", "true", "On", "yes"):  # Triton's interpreter, as Triton reads the variable
        monkeypatch.setenv("TRITON_INTERPRET", on)
        assert not pdl.supported("cuda:0")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.supported("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # Ampere
    assert not pdl.supported("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm's torch reports 9.x for MI300
    assert not pdl.supported("cuda:0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(pdl, "_triton_has_pdl", lambda: False)  # Triton before 3.4
    assert not pdl.supported("cuda:0")


def test_on_only_inside_its_context_and_only_on_its_thread(monkeypatch) -> None:
    monkeypatch.setattr(pdl, "supported", lambda device: True)  # as on a Hopper GPU
    seen = []
    with pdl.dependent_launches("cuda:0"):
        assert pdl.active() and pdl.flags() == {"PDL": True, "launch_pdl": True}
        t = threading.Thread(target=lambda: seen.append(pdl.active()))  # a worker's other model thread
        t.start()
        t.join()
        with pdl.dependent_launches("cuda:0"):
            assert pdl.active()
        assert pdl.active()  # a nested exit leaves the outer one on
    assert not pdl.active() and seen == [False]


def _chain():
    """Inputs of a chain of four of the decode step's kernels, and the chain: paged MLA decode
    (two launches) feeding a per-slot add + RMSNorm, feeding the greedy head (two launches)."""
    from engine.kernels.greedy_head import greedy_head
    from engine.kernels.mla_decode import mla_decode
    from engine.kernels.slot_norm import add_slots_rms_norm
    g = torch.Generator(device="cuda").manual_seed(3)
    b, h, rank, rope, bs = 4, 16, 512, 64, 16
    lens = torch.tensor([1, 100, 700, 1024], dtype=torch.int32, device="cuda")
    width = 1024 // bs
    kv = torch.randn(1 + b * width, 2, bs, rank + rope, device="cuda", generator=g).to(torch.bfloat16)
    tables = (torch.randperm(b * width, device="cuda", generator=g) + 1).view(b, width).int()
    q = torch.randn(b, h, rank + rope, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(b, h * rank // 8, device="cuda", generator=g).to(torch.bfloat16)  # hidden 1,024
    w = (torch.rand(h * rank // 8, device="cuda", generator=g) + 0.5).to(torch.bfloat16)

    def run():
        o = mla_decode(q, kv, 1, tables, lens, rank, 0.07)  # [b, h, rank]
        s, n = add_slots_rms_norm(x, o.float().view(b, 8, -1), w, 1e-6)  # 8 "slots" of 1,024
        tokens, logprobs = greedy_head(n.float().repeat(1, 40))  # a 40,960-token "vocabulary"
        return o, s, n, tokens, logprobs
    return run


@hopper
def test_a_graph_of_dependent_launches_gives_the_plain_eager_bits(monkeypatch) -> None:
    run = _chain()
    want = run()  # plain launches, eager
    asked = []
    flags = pdl.flags
    monkeypatch.setattr(pdl, "flags", lambda: asked.append(flags()) or asked[-1])  # what each launch asked
    with pdl.dependent_launches("cuda"):
        assert pdl.active()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            eager = run()  # launched with PDL, eager
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(want, eager, out):
        assert torch.equal(a, b) and torch.equal(a, c)
    # five launches a run (MLA 2, slot norm, greedy head 2), twice inside the context: all with PDL
    assert len(asked) == 10 and all(f == {"PDL": True, "launch_pdl": True} for f in asked)


@hopper
@pytest.mark.parametrize("lens", [[700], [3, 40, 100, 17, 250]])
def test_decode_graphs_give_the_same_bits_with_and_without_dependent_launches(monkeypatch, lens) -> None:
    """The worker's decode graphs (engine/graph_runner.py) on the seeded tiny model at batch 1 (its
    MoE layers' shared experts on a second branch) and 5: the logits with PDL on equal those with
    TANDEM_PDL=0, bit for bit, and repeat over replays."""
    from engine.kv_pool import KvPool, KvPoolConfig
    from engine.model_source import TINY, load_model
    from engine.runner import DecodeInput, ModelRunner
    loaded = load_model(TINY, dtype=torch.bfloat16)
    c = loaded.config
    model = loaded.model.to("cuda")
    outs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("TANDEM_PDL", mode)
        pool = KvPool(KvPoolConfig(num_blocks=200, block_size=16, num_layers=c.num_kv_layers, kv_dim=c.kv_dim,
                                   dtype=torch.bfloat16), 1, "cuda")
        torch.manual_seed(0)
        pool.kv.normal_(0, 0.5)
        tables = [pool.blocks.allocate(pool.blocks_for(n + 1)) for n in lens]
        batch = [DecodeInput(t, n, 5 + i) for i, (t, n) in enumerate(zip(tables, lens))]
        runner = ModelRunner(model, pool)
        before = pool.kv.clone()
        runner.capture_graphs(max_batch=8, max_context=1024)
        reps = []
        for _ in range(20):
            pool.kv.copy_(before)
            reps.append(runner.decode(batch).clone())
        torch.cuda.synchronize()
        assert all(torch.equal(r, reps[0]) for r in reps)
        outs[mode] = reps[0]
        del runner
    assert torch.equal(outs["1"], outs["0"])
