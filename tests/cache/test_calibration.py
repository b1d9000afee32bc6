"""Global-scale calibration: amax observer vs hand computation, global scale per format, checkpoint
k_scale/v_scale parsing, and what calibration buys NVFP4 on large-range data."""
import numpy as np
import pytest
import torch

from kvx_core.cache import PagedKVCache
from kvx_core.calibration import AmaxObserver, amax_from_checkpoint, global_scale_for_amax
from kvx_core.errors import KvxError, Status
from kvx_core.formats import get_format


def _raises(status, fn, *args, **kw):
    with pytest.raises(KvxError) as e:
        fn(*args, **kw)
    assert e.value.status == status
    return e.value


def test_observer_amax_per_tensor_and_per_head():
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 3, 16, generator=gen) * s, torch.randn(5, 3, 16, generator=gen) * 2 * s)
               for s in (1.0, 4.0, 0.5)]
    tensor, head = AmaxObserver(2), AmaxObserver(2, num_kv_heads=3, per_head=True)
    for k, v in batches:
        for obs in (tensor, head):
            obs.observe(1, k, v)
            obs.observe(1, k[:0], v[:0])  # an empty batch adds nothing
    ks = np.concatenate([k.numpy() for k, _ in batches])
    vs = np.concatenate([v.numpy() for _, v in batches])
    np.testing.assert_array_equal(tensor.amax[1, 0].numpy(), [np.abs(ks).max()])
    np.testing.assert_array_equal(tensor.amax[1, 1].numpy(), [np.abs(vs).max()])
    np.testing.assert_array_equal(head.amax[1, 0].numpy(), np.abs(ks).max(axis=(0, 2)))
    np.testing.assert_array_equal(head.amax[1, 1].numpy(), np.abs(vs).max(axis=(0, 2)))
    assert not tensor.amax[0].any() and not head.amax[0].any()  # layer 0 never observed


def test_observer_rejects_bad_input():
    obs = AmaxObserver(2, num_kv_heads=4, per_head=True)
    bad = torch.ones(2, 4, 16)
    bad[1, 2, 3] = float("inf")
    _raises(Status.INVALID_ARGUMENT, obs.observe, 0, bad, torch.ones(2, 4, 16))
    _raises(Status.INVALID_ARGUMENT, obs.observe, 0, torch.ones(2, 1, 16), torch.ones(2, 1, 16))  # 1 head, not 4
    _raises(Status.OUT_OF_RANGE, obs.observe, 2, torch.ones(2, 4, 16), torch.ones(2, 4, 16))
    _raises(Status.OUT_OF_RANGE, obs.observe, -1, torch.ones(2, 4, 16), torch.ones(2, 4, 16))
    assert not obs.amax.any()


def test_global_scale_for_amax_per_format():
    amax = torch.tensor([2688.0, 1.0, 0.0, 448.0])
    want = {
        "nvfp4": [1.0, 1 / 2688, 1.0, 448 / 2688],  # amax / (6 * 448); amax 0 keeps 1.0
        "fp8_e4m3": [6.0, 1 / 448, 1.0, 1.0],  # amax / 448
        "fp8_e5m2": [2688 / 57344, 1 / 57344, 1.0, 448 / 57344],  # amax / 57344
    }
    for name, w in want.items():
        g = global_scale_for_amax(get_format(name).k, amax)
        assert g.dtype == torch.float32
        np.testing.assert_allclose(g.numpy(), np.float32(w), rtol=1e-7)
    for name in ("int8", "int4", "mxfp4", "bf16"):
        assert global_scale_for_amax(get_format(name).k, amax) is None
    _raises(Status.INVALID_ARGUMENT, global_scale_for_amax, get_format("nvfp4").k, torch.tensor([float("nan")]))


def test_observer_global_scales_per_cache_format():
    obs = AmaxObserver(2)
    obs.observe(0, torch.full((1, 1, 16), 896.0), torch.full((1, 1, 16), -5376.0))
    obs.observe(1, torch.full((1, 1, 16), 44.8), torch.zeros(1, 1, 16))
    (k0, v0), (k1, v1) = obs.global_scales(get_format("k8v4"))  # K FP8 E4M3, V NVFP4
    assert float(k0) == pytest.approx(2.0) and float(v0) == pytest.approx(2.0)
    assert float(k1) == pytest.approx(0.1) and float(v1) == 1.0  # V never non-zero: 1.0
    assert obs.global_scales(get_format("int4")) == [(None, None), (None, None)]


def _ckpt(num_layers: int, k: float = 0.5, v: float = 0.25, heads: int | None = None,
          name: str = "model.layers.{i}.self_attn.{w}_scale") -> dict[str, torch.Tensor]:
    sd = {}
    for i in range(num_layers):
        for w, s in (("k", k), ("v", v)):
            sd[name.format(i=i, w=w)] = torch.tensor(s * (i + 1)) if heads is None else \
                torch.arange(1, heads + 1, dtype=torch.float32) * s * (i + 1)
        sd[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(2, 2)
        sd[f"model.layers.{i}.self_attn.k_proj.weight_scale"] = torch.tensor(9.0)
        sd[f"model.layers.{i}.self_attn.k_proj.input_scale"] = torch.tensor(9.0)
    return sd


def test_amax_from_checkpoint_parses_vllm_modelopt_keys():
    out = amax_from_checkpoint(_ckpt(3), 3)
    assert out.shape == (3, 2, 1)
    for i in range(3):
        assert out[i, 0, 0] == 0.5 * (i + 1) * 448 and out[i, 1, 0] == 0.25 * (i + 1) * 448
    out = amax_from_checkpoint(_ckpt(2, heads=4, name="model.layers.{i}.self_attn.attn.{w}_scale"), 2)
    assert out.shape == (2, 2, 4)
    np.testing.assert_allclose(out[1, 0].numpy(), np.arange(1, 5) * 0.5 * 2 * 448)
    out = amax_from_checkpoint(_ckpt(1, name="layers.{i}.attention.{w}_proj.{w}_scale"), 1)
    assert out[0, 0, 0] == 224 and out[0, 1, 0] == 112
    assert amax_from_checkpoint({"model.layers.0.mlp.down_proj.weight": torch.zeros(1)}, 1) is None
    # from amax to NVFP4 global scale: k_scale * 448 / 2688 = k_scale / 6
    g = global_scale_for_amax(get_format("nvfp4").k, amax_from_checkpoint(_ckpt(1, k=0.6), 1)[0, 0])
    assert float(g) == pytest.approx(0.1)


def test_amax_from_checkpoint_rejects_partial_and_foreign_sets():
    partial = _ckpt(3)
    del partial["model.layers.1.self_attn.v_scale"]
    e = _raises(Status.INVALID_ARGUMENT, amax_from_checkpoint, partial, 3)
    assert "(1, 'v')" in e.message
    _raises(Status.INVALID_ARGUMENT, amax_from_checkpoint, _ckpt(2), 3)  # layer 2 missing entirely
    _raises(Status.INVALID_ARGUMENT, amax_from_checkpoint, _ckpt(4), 3)  # layer 3 beyond the model
    mixed = _ckpt(2, heads=4)
    mixed["model.layers.1.self_attn.k_scale"] = torch.ones(2)  # 2 heads here, 4 elsewhere
    _raises(Status.INVALID_ARGUMENT, amax_from_checkpoint, mixed, 2)


def test_calibrated_nvfp4_handles_large_range_that_overflows_default_scale():
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(32, 2, 64, generator=gen) * 1.0e4
    v = torch.randn(32, 2, 64, generator=gen) * 3.0e3
    obs = AmaxObserver(1)
    obs.observe(0, k, v)
    fmt = get_format("nvfp4")
    assert bool(fmt.k.scale_overflow(k).any())  # g = 1: group scales amax/6 >> 448 saturate
    errs = {}
    for name, g in (("g=1", None), ("calibrated", obs.global_scales(fmt))):
        cache = PagedKVCache(fmt, num_layers=1, num_blocks=2, block_size=16, num_kv_heads=2, head_dim=64,
                             global_scales=g)
        cache.write(0, k, v, torch.arange(32))
        kk, vv = cache.gather(0, torch.tensor([[0, 1]]), torch.tensor([32]))
        errs[name] = max(float((kk - k).norm() / k.norm()), float((vv - v).norm() / v.norm()))
    assert errs["calibrated"] < 0.15, errs  # ordinary NVFP4 noise (~0.1 on normal data)
    assert errs["g=1"] > 0.5 and errs["g=1"] > 5 * errs["calibrated"], errs
    g_k = cache.layers[0].k_global
    assert float(g_k) == pytest.approx(float(k.abs().max()) / 2688, rel=1e-6)


# ------------------------------------------------------------------ the "mse" rule (SampleObserver, mse_global_scale)
def _err(tf, x, g):
    payload, scales = tf.encode(x, g)
    return ((tf.decode(payload, scales, g) - x) ** 2).sum(dim=(0, 2))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_mse_scale_is_the_grid_argmin(name):
    """Three heads: gaussian, gaussian with rare 40x outliers, and tiny values; the chosen scale is the brute-force
    argmin (first minimum) per head over the rule's grid: powers of two around the amax scale's octave for FP8,
    quarter octaves around the amax scale for NVFP4 (which then never does worse than the amax rule)."""
    import math

    from kvx_core.calibration import global_scale_for_amax, mse_global_scale

    tf = get_format(name).k
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 3, 64, generator=g)
    x[:, 1] += 40 * (torch.rand(256, 64, generator=g) < 0.002) * torch.randn(256, 64, generator=g)
    x[:, 2] *= 1e-3
    got = mse_global_scale(tf, x)
    base = global_scale_for_amax(tf, x.abs().amax(dim=(0, 2)))
    for h in range(3):
        xs = x[:, h:h + 1]
        b = float(base[h])
        cands = ([2.0 ** (math.floor(math.log2(b)) + j) for j in range(-6, 2)] if name.startswith("fp8")
                 else [float(torch.tensor(b) * 2.0 ** (j / 4)) for j in range(-24, 5)])
        errs = [float(_err(tf, xs, torch.tensor([c]))) for c in cands]
        k = min(range(len(errs)), key=lambda i: (errs[i], i))
        assert float(got[h]) == cands[k], (name, h, float(got[h]), cands[k])
        if name == "nvfp4":
            assert errs[k] <= float(_err(tf, xs, base[h:h + 1]))
    assert mse_global_scale(get_format("int8").k, x) is None


def test_sample_observer_rules_and_refusals():
    from kvx_core.calibration import SampleObserver, global_scale_for_amax, mse_global_scale

    fmt = get_format("k8v4")
    obs = SampleObserver(num_layers=2, max_tokens=100)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # 3 x 60 tokens, 100 kept per layer
        for layer in range(2):
            obs.observe(layer, torch.randn(60, 2, 32, generator=g), torch.randn(60, 2, 32, generator=g) * 3)
    k, v = obs.values(0)
    assert k.shape == (100, 2, 32) and v.shape == (100, 2, 32)
    (kg, vg), _ = obs.global_scales(fmt, "mse")
    assert torch.equal(kg, mse_global_scale(fmt.k, k)) and torch.equal(vg, mse_global_scale(fmt.v, v))
    (ka, va), _ = obs.global_scales(fmt, "amax")
    assert torch.equal(ka, global_scale_for_amax(fmt.k, k.abs().amax(dim=(0, 2))))
    with pytest.raises(KvxError, match="scale rule"):
        obs.global_scales(fmt, "percentile")
    bad = torch.randn(4, 2, 32)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(KvxError, match="non-finite"):
        obs.observe(1, torch.randn(4, 2, 32), bad)
    with pytest.raises(KvxError, match="no calibration values"):
        SampleObserver(1).values(0)
