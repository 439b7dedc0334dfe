"""autotune: candidates, checks against the heuristic's result, the persistent cache, the
policy variable, and the plan reading the cache inside jit."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_bsattn as bsa
from eqx_bsattn.contract import MaskReads
from eqx_bsattn import _cache
from eqx_bsattn.strategies.kernels.reference import reference_attention
from eqx_bsattn.strategies.kernels.triton import heuristics as triton_heuristics
from tests.conftest import assert_close, np_attention, np_visibility

HERE = pathlib.Path(__file__).parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty cache folder and the default policy."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_DIR_VARIABLE, str(folder))
    monkeypatch.delenv(_cache.POLICY_VARIABLE, raising=False)
    return folder


class _Flawed(bsa.AbstractKernel):
    """A test kernel: exact (the dense reference) except at some tilings. block_q=64 adds an
    error to the output; block_q=48 leaves the output right and breaks the query gradient;
    block_q=24 fails to trace, like a launch that does not compile. Its candidates: 32 (its
    heuristic), 64, 48, 24, 16 and a 40 it rejects."""

    name: ClassVar[str] = "flawed"
    platforms: ClassVar[tuple[str, ...]] = ("cpu",)
    reads: ClassVar[MaskReads] = "dense"

    @classmethod
    def priority(cls, platform):
        return None

    def decline_reason(self, mask, features):
        return None

    def default_tiling(self, features, mask):
        return bsa.Tiling(block_q=32, block_kv=32)

    def tiling_candidates(self, features, mask):
        runnable = tuple((bsa.Tiling(block_q=b, block_kv=32), None) for b in (32, 64, 48, 24, 16))
        return runnable + ((bsa.Tiling(block_q=40, block_kv=32), "40 is not a launchable block"),)

    def __call__(self, query, key, value, *, mask, inputs, features, tiling, softmax_scale,
                 logits_soft_cap):
        if tiling.block_q == 24:
            raise RuntimeError("no launch for block_q=24\nsecond line")
        out = reference_attention(query, key, value, mask=mask, inputs=inputs,
                                  softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)
        if tiling.block_q == 64:
            out = out + 0.25 * out[..., :1, :]  # one query row leaks into all
        if tiling.block_q == 48:
            q = query[..., : out.shape[-1]]
            out = out + 0.5 * (q - jax.lax.stop_gradient(q))  # same values, other gradient
        return out


class _Two(_Flawed):
    """`_Flawed` with two good candidates: 32 (the heuristic) and 16."""

    def tiling_candidates(self, features, mask):
        return tuple((bsa.Tiling(block_q=b, block_kv=32), None) for b in (32, 16))


def _qkv(seed=0, shape=(1, 2, 64, 16)):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, shape) for k in keys)


# ------------------------------------------------------------------------------------------------
# Candidates.


def _resolved(mask, features):
    return bsa.ResolvedMask(mask, q_len=features.q_len, kv_len=features.kv_len,
                            num_heads=features.num_heads)


def test_xla_candidates_start_with_the_heuristic_and_run_distinct_tilings():
    kernel = bsa.kernels.XlaBlockSparse()
    features = bsa.Features(platform="cpu", q_len=200, kv_len=96, head_dim=32, value_dim=32)
    resolved = _resolved(bsa.masks.Causal(), features)
    listed = kernel.tiling_candidates(features, resolved)
    tilings = [t for t, why in listed]
    assert all(why is None for _, why in listed)
    assert tilings[0] == kernel.adapt_tiling(kernel.default_tiling(features, resolved).explicit(),
                                             features)
    assert len(set(tilings)) == len(tilings) > 6
    # Each is what the kernel runs (blocks shrunk to the sequence), so no two run alike.
    for t in tilings:
        assert kernel.adapt_tiling(t, features) == t
        assert isinstance(t, bsa.kernels.XlaConfig)
        assert t.block_kv <= 96 and t.blocks.dkv[1] <= 96 and t.blocks.dq[1] <= 96


def test_triton_candidates_fit_the_launch_limits_or_say_why_not():
    kernel = bsa.kernels.TritonBlockSparse()
    features = bsa.Features(platform="gpu", dtype="bfloat16", head_dim=128, value_dim=128,
                            q_len=16384, kv_len=16384)
    resolved = _resolved(bsa.masks.Causal(), features)
    listed = kernel.tiling_candidates(features, resolved)
    assert listed[0] == (kernel.default_tiling(features, resolved).explicit(), None)
    reasons = [why for _, why in listed if why is not None]
    assert reasons and all("KiB of shared memory" in why for why in reasons)
    for tiling, why in listed:
        used = triton_heuristics.shared_memory(tiling, features)
        fits = max(used.values()) <= triton_heuristics.SHARED_MEMORY_BYTES
        assert fits == (why is None), (tiling, used, why)
        if why is None:
            kernel.adapt_tiling(tiling, features)  # powers of two >= 16
    # The short-row heuristic's 82 KiB forward and ~99 KiB dq (bf16, D=128, 64x64, 2 stages).
    short = bsa.kernels.TritonConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
    used = triton_heuristics.shared_memory(short, features)
    assert 78 <= used["forward"] / 1024 <= 86 and 92 <= used["dq"] / 1024 <= 104
    # A block Triton cannot launch is refused when the config is built, with the field's name.
    with pytest.raises(ValueError, match="TritonConfig.block_q to be a power of two"):
        bsa.kernels.TritonConfig(block_q=48, block_kv=64)
    # Short sequences cap the blocks as the heuristic does; float32 doubles the tiles.
    small = bsa.Features(platform="gpu", dtype="float32", head_dim=128, value_dim=128,
                         q_len=40, kv_len=40)
    for tiling, why in kernel.tiling_candidates(small, _resolved(bsa.masks.Causal(), small)):
        assert max(tiling.block_q, tiling.block_kv, *tiling.backward_blocks, *tiling.dq_blocks) <= 64


def test_kernels_without_choices_offer_their_heuristic():
    features = bsa.Features()
    resolved = _resolved(bsa.masks.Causal(), features)
    for kernel in (bsa.kernels.DenseReference(), _Flawed()):
        listed = bsa.AbstractKernel.tiling_candidates(kernel, features, resolved)
        assert listed == ((kernel.default_tiling(features, resolved), None),)


# ------------------------------------------------------------------------------------------------
# Tuning.


@pytest.mark.slow
def test_autotune_rejects_wrong_and_failing_candidates_and_reports_them(cache_dir):
    q, k, v = _qkv()
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed())
    tuned, report = bsa.autotune(attn, q, k, v, reps=1, progress=False)
    # Timing noise decides whether the fastest forward and forward+backward differ and a
    # combination of the two is tried as well.
    listed = [t for t in report.trials if t.origin != "combined"]
    assert len(report.trials) - len(listed) <= 1
    by_block = {t.tiling.block_q: t for t in listed}
    assert [t.tiling.block_q for t in listed] == [32, 64, 48, 24, 16, 40]
    assert by_block[32].origin == "heuristic" and by_block[32].error == 0.0
    assert by_block[64].status == "wrong" and by_block[64].error > 0.05
    assert "forward differs" in by_block[64].reason
    # The forward of 48 is right; its gradient is not, and the check sees it.
    assert by_block[48].status == "wrong" and "forward+backward differs" in by_block[48].reason
    assert by_block[48].forward_ms is not None and by_block[48].forward_backward_ms is None
    assert by_block[24].status == "failed" and "RuntimeError: no launch for block_q=24" in by_block[24].reason
    assert "second line" not in by_block[24].reason
    assert by_block[40].status == "rejected" and "not a launchable block" in by_block[40].reason
    ok = [t for t in report.trials if t.status == "ok"]
    assert {t.tiling.block_q for t in ok} == {32, 16}
    assert report.winner in ok and report.winner.tiling == report.best
    for t in ok:
        assert t.forward_ms > 0 and t.forward_backward_ms > 0 and t.error <= 2e-3
    assert report.best.block_q in (32, 16) and tuned.tiling == report.best
    assert report.speedup >= 1.0 and attn.tiling == bsa.AutoTiling()  # the original is untouched
    text = str(report)
    for word in ("wrong", "failed", "rejected", "fwd+bwd ms", "*", "cached in"):
        assert word in text
    assert report.cache_file == str(cache_dir / "autotune.json")
    # The tuned module is right, against the independent float64 oracle.
    vis = np_visibility(attn.mask, batch=1, heads=2, q_len=64, kv_len=64)
    assert_close(tuned(q, k, v), np_attention(q, k, v, vis), 2e-5, "tuned")


def test_autotune_forward_only_limits_candidates_and_keeps_the_module_tiling_as_a_candidate(cache_dir):
    q, k, v = _qkv(1)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed(),
                                    tiling=bsa.Tiling(block_q=16, block_kv=16))
    _, report = bsa.autotune(attn, q, k, v, backward=False, max_candidates=3, cache=False,
                             reps=1, progress=False)
    origins = [(t.tiling.block_q, t.origin) for t in report.trials if t.status != "rejected"]
    assert origins == [(32, "heuristic"), (16, "module"), (64, "kernel")]
    assert report.untried == 3 and "not tried" in str(report)
    assert all(t.forward_backward_ms is None for t in report.trials)
    assert report.cache_file is None and not cache_dir.exists()


def test_autotune_raises_when_the_heuristic_does_not_run():
    q = jax.random.normal(jax.random.key(4), (1, 2, 40, 8))

    class _FailsAtHeuristic(_Flawed):
        def default_tiling(self, features, mask):
            return bsa.Tiling(block_q=24, block_kv=32)

    attn = bsa.BlockSparseAttention(kernel=_FailsAtHeuristic())
    with pytest.raises(ValueError, match="heuristic config .* does not run .*RuntimeError: no launch"):
        bsa.autotune(attn, q, q, q, reps=1, progress=False, cache=False)


# ------------------------------------------------------------------------------------------------
# The cache and the plan.


def test_plan_reads_the_tuned_tiling_from_the_cache_inside_jit():
    q, k, v = _qkv(2)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed())
    assert attn.plan(q, k, v).tiling_source == "heuristic"
    _, report = bsa.autotune(attn, q, k, v, candidates=[bsa.Tiling(block_q=16, block_kv=16)],
                             reps=1, progress=False)
    seen = []

    @jax.jit
    def f(q, k, v):
        plan = attn.plan(q, k, v)
        seen.append((plan.tiling_source, plan.tiling))
        return attn(q, k, v)

    f(q, k, v)
    assert seen == [("cache", report.best)]
    assert "from the autotune cache" in attn.plan(q, k, v).explain()
    # Another mask, length or batch misses the entry.
    other = bsa.BlockSparseAttention(mask=bsa.masks.SlidingWindow(8, 0), kernel=_Flawed())
    assert other.plan(q, k, v).tiling_source == "heuristic"
    assert attn.plan(q[:, :, :32], k, v).tiling_source == "heuristic"
    assert attn.plan(q[0], k[0], v[0]).tiling_source == "cache"  # unbatched = batch of one


@pytest.mark.slow
def test_policy_variable(monkeypatch, cache_dir):
    q, k, v = _qkv(3)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Two())
    plan = attn.plan(q, k, v)
    _cache.store(plan.kernel, plan.features, plan.resolved, bsa.Tiling(block_q=16, block_kv=16), {})
    monkeypatch.setenv(_cache.POLICY_VARIABLE, "heuristics")
    assert attn.plan(q, k, v).tiling_source == "heuristic"
    monkeypatch.setenv(_cache.POLICY_VARIABLE, "cache")
    assert attn.plan(q, k, v).tiling_source == "cache"
    monkeypatch.setenv(_cache.POLICY_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="EQX_BSATTN_AUTOTUNE .* heuristics, cache; got"):
        attn.plan(q, k, v)
    # tune (deprecated): reads as `cache`, with a warning that names `autotune`; a trace never
    # tunes, so a miss takes the heuristic and nothing is written.
    monkeypatch.setenv(_cache.POLICY_VARIABLE, "tune")
    written = (cache_dir / "autotune.json").read_text()
    with pytest.warns(DeprecationWarning, match="reads as 'cache'.*eqx_bsattn.autotune"):
        assert attn.plan(q, k, v).tiling_source == "cache"
    seen = []
    ids = jnp.asarray(np.repeat([0, 1], 16), jnp.int32)
    k, v = k[:, :, :32], v[:, :, :32]

    def body(q, ids):
        plan = attn.plan(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)
        seen.append(plan.tiling_source)
        return attn(q, k, v, q_segment_ids=ids, kv_segment_ids=ids)

    with pytest.warns(DeprecationWarning):
        out = jax.jit(lambda q, ids: body(q, ids))(q[:, :, :32], ids)
    assert seen == ["heuristic"]
    assert (cache_dir / "autotune.json").read_text() == written
    vis = np_visibility(attn.mask & bsa.masks.Document(), batch=1, heads=2, q_len=32, kv_len=32,
                        q_seg=np.asarray(ids)[None], kv_seg=np.asarray(ids)[None])
    assert_close(out, np_attention(q[:, :, :32], k, v, vis), 2e-5, "heuristic")


def test_corrupt_or_foreign_cache_files_warn_and_never_fail(cache_dir, monkeypatch):
    q, k, v = _qkv(5)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed())
    path = cache_dir / "autotune.json"
    cache_dir.mkdir()
    path.write_text('{"format": "eqx_bsattn.autotune/1", "entries": {')
    with pytest.warns(RuntimeWarning, match="not valid JSON"):
        assert attn.plan(q, k, v).tiling_source == "heuristic"
    # Tuning replaces a corrupt file with a valid one.
    with pytest.warns(RuntimeWarning, match="not valid JSON"):
        _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    assert report.cache_file == str(path) and attn.plan(q, k, v).tiling_source == "cache"
    # An entry the kernel cannot run (edited by hand) warns and falls back to the heuristic.
    data = json.loads(path.read_text())
    (entry,) = [e for by_mask in data["entries"].values() for e in by_mask.values()]
    entry["tiling"] = {"block_q": -3, "block_kv": 32}
    path.write_text(json.dumps(data))
    with pytest.warns(RuntimeWarning, match="cannot be used"):
        assert attn.plan(q, k, v).tiling_source == "heuristic"
    # A file of another format is read as empty and never overwritten.
    foreign = json.dumps({"format": "something else", "entries": {}})
    path.write_text(foreign)
    with pytest.warns(RuntimeWarning, match="not an eqx_bsattn autotune cache"):
        assert attn.plan(q, k, v).tiling_source == "heuristic"
    with pytest.warns(RuntimeWarning, match="left alone"):
        _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    assert report.cache_file is None and path.read_text() == foreign
    # A cache folder that cannot be created warns and keeps nothing.
    blocker = cache_dir / "file"
    blocker.write_text("")
    monkeypatch.setenv(_cache.CACHE_DIR_VARIABLE, str(blocker / "sub"))
    with pytest.warns(RuntimeWarning, match="cannot write"):
        _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    assert report.cache_file is None


def _plan_warnings(attn, q, k, v) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attn.plan(q, k, v).tiling_source in ("heuristic", "cache")
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("content, problem", [
    (b'{"format": "eqx_bsattn.autotune/1", "entries": {"\xff\xfe": {}}}', "not UTF-8 text"),
    (b"[" * 200_000 + b"]" * 200_000, "not valid JSON (nested too deeply)"),
], ids=["not_utf8", "deeply_nested"])
def test_unreadable_cache_files_warn_once_and_never_fail(cache_dir, content, problem):
    q, k, v = _qkv(6)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed())
    path = cache_dir / "autotune.json"
    cache_dir.mkdir()
    path.write_bytes(content)
    warned = _plan_warnings(attn, q, k, v)
    assert len(warned) == 1 and problem in warned[0] and "ignored" in warned[0], warned
    assert _plan_warnings(attn, q, k, v) == []  # once per version of the file
    assert np.isfinite(np.asarray(attn(q, k, v))).all()  # an untiled call runs
    with pytest.warns(RuntimeWarning, match=problem.split(" (")[0]):
        _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    assert report.cache_file == str(path) and attn.plan(q, k, v).tiling_source == "cache"


def test_malformed_cache_entries_warn_once_and_are_dropped(cache_dir):
    q, k, v = _qkv(7)
    attn = bsa.BlockSparseAttention(mask=bsa.masks.Causal(), kernel=_Flawed())
    path = cache_dir / "autotune.json"
    _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    data = json.loads(path.read_text())
    (call,) = data["entries"]
    (mask,) = data["entries"][call]
    data["entries"]["another call"] = ["not", "a", "dict"]
    data["entries"][call] = {mask: "not a dict"}
    path.write_text(json.dumps(data))
    warned = _plan_warnings(attn, q, k, v)
    assert len(warned) == 1 and "2 malformed entries" in warned[0], warned
    assert attn.plan(q, k, v).tiling_source == "heuristic"
    assert _plan_warnings(attn, q, k, v) == []
    with pytest.warns(RuntimeWarning, match="malformed"):  # autotune(cache=True) went TypeError
        _, report = bsa.autotune(attn, q, k, v, candidates=[], reps=1, progress=False)
    kept = json.loads(path.read_text())["entries"]
    assert list(kept) == [call] and isinstance(kept[call][mask], dict)
    assert _plan_warnings(attn, q, k, v) == [] and attn.plan(q, k, v).tiling_source == "cache"


_WORKER = r"""
import json, sys
import jax, numpy as np
import eqx_bsattn as bsa
from eqx_bsattn import _cache
from eqx_bsattn.bench import bigbird_mask

def masks():
    n = 3
    yield "causal", bsa.masks.Causal()
    yield "window", bsa.masks.Causal() & bsa.masks.SlidingWindow(64, 0)
    yield "bigbird", bigbird_mask(512)
    yield "document", bsa.masks.Causal() & bsa.masks.Document()
    yield "every 3rd", bsa.masks.Predicate(lambda q, k: (q - k) % n == 0)
    n = 5  # the same code, another closure
    yield "every 5th", bsa.masks.Predicate(lambda q, k: (q - k) % n == 0)

kernel = bsa.kernels.XlaBlockSparse()
features = bsa.Features(q_len=512, kv_len=512, num_heads=4, num_kv_heads=4)
keys = {}
for name, mask in masks():
    resolved = bsa.ResolvedMask(mask, q_len=512, kv_len=512, num_heads=4)
    keys[name] = _cache.call_key(kernel, features) + " | " + _cache.mask_key(resolved)
print(json.dumps(keys), flush=True)
sys.stdin.readline()  # every worker starts writing at once
for i in range(25):
    _cache.write_entry(f"call {sys.argv[1]}", f"mask {i}", {"tiling": {"block_q": 16, "block_kv": 16}})
print("done", flush=True)
"""


@pytest.mark.slow
def test_two_processes_write_at_once_and_agree_on_keys(cache_dir):
    env = dict(os.environ, EQX_BSATTN_TYPECHECK="0")
    workers = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env, cwd=HERE.parent)
        for n in range(2)
    ]
    try:
        keys = [json.loads(w.stdout.readline()) for w in workers]
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        for w in workers:
            assert w.stdout.readline().strip() == "done"
            assert w.wait(timeout=60) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.communicate()
    entries = json.loads((cache_dir / "autotune.json").read_text())["entries"]
    assert {call: len(by_mask) for call, by_mask in entries.items()} == {"call 0": 25, "call 1": 25}
    # The same masks give the same keys in both processes, and each mask its own key.
    assert keys[0] == keys[1]
    assert len(set(keys[0].values())) == len(keys[0])
    # ... and in this process too.
    from eqx_bsattn.bench import bigbird_mask

    resolved = bsa.ResolvedMask(bigbird_mask(512), q_len=512, kv_len=512, num_heads=4)
    features = bsa.Features(q_len=512, kv_len=512, num_heads=4, num_kv_heads=4)
    mine = _cache.call_key(bsa.kernels.XlaBlockSparse(), features) + " | " + _cache.mask_key(resolved)
    assert mine == keys[0]["bigbird"]


def test_blocksparse_attention_with_cfg_none_reads_the_cache(monkeypatch):
    from eqx_bsattn import _api

    q, k, v = _qkv(6)
    plan = bsa.BlockSparseAttention(mask=bsa.masks.Causal()).plan(q, k, v)
    tuned = bsa.Tiling(block_q=32, block_kv=16)
    _cache.store(plan.kernel, plan.features, plan.resolved, tuned, {})
    plans = []

    def record(plan, query, *args, **kwargs):
        plans.append(plan)
        return query

    monkeypatch.setattr(_api, "run_plan", record)
    bsa.blocksparse_attention(q, k, v, causal=True)
    bsa.blocksparse_attention(q, k, v, causal=True, cfg={"block_q": 16, "block_kv": 16})
    assert [(p.tiling_source, p.tiling.block_q, p.tiling.block_kv) for p in plans] == [
        ("cache", 32, 16), ("module", 16, 16)]


def test_score_terms_are_part_of_the_call_key():
    """A config tuned without score terms is not found for a call with them, nor one tuned
    with ALiBi for a call with a table."""
    kernel = bsa.kernels.TritonBlockSparse()
    keys = {score: _cache.call_key(kernel, bsa.Features(platform="gpu", score=score))
            for score in ((), ("alibi",), ("relative_bias",), ("alibi", "relative_bias"))}
    assert len(set(keys.values())) == len(keys)
    assert "score=alibi,relative_bias" in keys[("alibi", "relative_bias")]
    assert "score" not in keys[()]


def test_a_call_inside_a_sharding_loop_is_keyed_apart_and_its_slot_round_trips(cache_dir):
    """`Features.in_loop` (the ring) changes the slot `XlaBlockSparse` runs, so a config tuned
    there is not read for the same call unsharded; keys without it are as before; a config's
    `slot_elements` is written and read back (one left unset stays unset)."""
    kernel = bsa.kernels.XlaBlockSparse()
    plain = bsa.Features(platform="cpu", q_len=64, kv_len=64, positions=True)
    looped = dataclasses.replace(plain, in_loop=True)
    assert "in_loop" not in _cache.call_key(kernel, plain)
    assert _cache.call_key(kernel, looped) == _cache.call_key(kernel, plain) + " in_loop"
    resolved = _resolved(bsa.masks.Causal(), plain)
    ring_config = kernel.adapt_tiling(kernel.default_tiling(looped, resolved), looped)
    assert ring_config.slot_elements == 1 << 21
    assert _cache.store(kernel, looped, resolved, ring_config, {})
    assert _cache.lookup(kernel, looped, resolved) == ring_config
    assert _cache.lookup(kernel, plain, resolved) is None
    unset = kernel.adapt_tiling(kernel.default_tiling(plain, resolved), plain)
    assert "slot_elements" not in _cache.tiling_to_json(unset)
    assert _cache.store(kernel, plain, resolved, unset, {})
    assert _cache.lookup(kernel, plain, resolved) == unset
