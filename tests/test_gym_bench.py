"""benchmarks/gym_gpu.py and its torch peer on the CPU: the peer's torch forms of the
attention-gym functions say what the JAX ones say (run on NumPy arrays standing in for torch's,
which is absent here), and the script times our side and counts visible pairs right."""

import importlib.util
import json
import pathlib
import sys
import types

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package; the peer imports its
    sibling flex_peer.py by name, as when run as a script)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Tensor(np.ndarray):
    """A NumPy array with the one tensor method the peer's functions call."""

    def abs(self):
        return np.abs(self)


_TORCH = types.SimpleNamespace(
    clamp=lambda x, low, high: np.minimum(np.maximum(x, low), high).view(_Tensor),
    where=lambda c, a, b: np.where(c, a, b).view(_Tensor), tanh=np.tanh, exp2=np.exp2)


def test_the_peer_torch_forms_match_the_jax_catalogue():
    gym, peer = _script("gym_gpu"), _script("flex_gym_peer")
    heads = 2
    b, h = np.zeros((1, 1, 1, 1), np.int32), np.arange(heads).reshape(1, heads, 1, 1)
    for name, build in gym.cases(128, 1, heads).items():
        case = build()
        shape = (1, heads, case.q_len, case.kv_len)
        q = np.arange(case.q_len).reshape(1, 1, -1, 1).view(_Tensor)
        kv = np.arange(case.kv_len).reshape(1, 1, 1, -1).view(_Tensor)
        mask_mod, score_mod = peer.functions(_TORCH, name, case.args, case.arrays)
        assert (mask_mod is None) == (case.mask_mod is None or case.mask_mod is gym.gym.noop_mask)
        if mask_mod is not None:
            extra = () if case.params is None or case.score_params else (case.params,)
            want = np.broadcast_to(np.asarray(case.mask_mod(b, h, q, kv, *extra)), shape)
            got = np.broadcast_to(np.asarray(mask_mod(b, h, q, kv)), shape)
            assert want.any() and np.array_equal(got, want), name
        assert (score_mod is None) == (case.score_mod is None), name
        if score_mod is not None:
            score = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            extra = (case.params,) if case.score_params else ()
            want = np.broadcast_to(np.asarray(case.score_mod(score, b, h, q, kv, *extra)), shape)
            got = np.broadcast_to(np.asarray(score_mod(score.view(_Tensor), b, h, q, kv)), shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_the_gym_script_times_our_side_and_counts_pairs(tmp_path, capsys):
    gym = _script("gym_gpu")
    out = tmp_path / "gym.json"
    gym.main(["--length", "64", "--batch", "1", "--heads", "2", "--dim", "16", "--reps", "1",
              "--dtype", "float32", "--no-flex", "--cases", "sliding_window", "natten",
              "--out", str(out)])
    records = {r["case"]: r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {"sliding_window", "natten"}
    for name, r in records.items():
        case = gym.cases(64, 1, 2)[name]()
        q, kv = np.arange(case.q_len)[:, None], np.arange(case.kv_len)[None, :]
        assert r["pairs"] == int(np.sum(np.asarray(case.mask_mod(0, 0, q, kv)))), name
        # 64 x 64 is a small call on a CPU: the selector runs it dense.
        assert r["ours"]["kernel"] == "DenseReference" and r["ours"]["fwdbwd_ms"] > 0, r
    assert records["natten"]["ours"]["form"] == "from_flex"
    assert "| sliding_window | 64x64 |" in capsys.readouterr().out
