"""rq_jax.sharding: partition specs of params, caches and calibration, and generation on a mesh.

The spec rules are checked here on abstract meshes. Generation runs in a subprocess on 8 simulated CPU
devices (this process's JAX already has one): the same greedy tokens as one device for the dense and
residual caches on data=4,model=2 (GQA: 4 query heads over 2 kv heads), and on a mesh whose model axis
divides neither the kv heads nor the batch (everything falls back to replication but the MLP); the
cache really split as specified; the native kernels called per device shard; and no all-gather of
cache-sized operands in the compiled decode step.

    python tests/test_sharding.py     # the subprocess: prints one line "RESULT {json}"
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import cpu_kernels
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from rq_jax import sharding
from rq_jax.cache import CacheCalib, RVQCalib, default_calib, get_format, init_cache
from rq_jax.config import preset
from rq_jax.models import init_model
from rq_jax.quant.rvq import RVQCodebooks

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LEN = 37  # a prime no activation dimension is a multiple of: a gathered cache would show it
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
RESIDUAL = get_format("residual", bits=(2, 4))  # ResidualQuant on a group of the model's 2 loops


def abstract_mesh(data: int, model: int) -> AbstractMesh:
    return AbstractMesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def ouro_config(heads=4, kv_heads=2):
    """A tiny Ouro: 1 layer × 2 loops, head_dim 32, vocab 128."""
    return preset("ouro-tiny").replace(num_layers=1, num_loops=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=32,
                                       hidden_size=64, intermediate_size=64)


def specs_by_name(state, config, mesh) -> dict[str, P]:
    specs = sharding.param_specs(state, config, mesh)
    return {sharding._path(path): spec for path, spec in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, P))}


# ---- specs (this process) -------------------------------------------------------------------------


def test_parse_mesh():
    assert sharding.parse_mesh(None) is None and sharding.parse_mesh("") is None
    mesh = sharding.parse_mesh("model=1")
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    for bad in ("batch=1", "data=0", "data=1,data=1", "data=two", f"data={jax.device_count() + 1}"):
        with pytest.raises(ValueError):
            sharding.parse_mesh(bad)


def test_param_specs_follow_kv_heads():
    """GQA: q/k/v split on their output (head-major) axis, o on its input, when model divides K."""
    config = ouro_config(heads=4, kv_heads=2)
    state = nnx.state(nnx.eval_shape(lambda: init_model(config)))
    specs = specs_by_name(state, config, abstract_mesh(4, 2))
    for name in ("q_proj", "k_proj", "v_proj"):
        assert specs[f"layers.self_attn.{name}.kernel"] == P(None, None, "model")
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, "model", None)
    assert specs["layers.mlp.gate_proj.kernel"] == P(None, None, "model")
    assert specs["layers.mlp.down_proj.kernel"] == P(None, "model", None)
    assert specs["lm_head.kernel"] == P(None, "model")  # vocab 128
    assert specs["embed_tokens.embedding"] == P() and specs["norm.weight"] == P()
    # 2 kv heads cannot be split 4 ways: attention replicated, the MLP still split.
    specs = specs_by_name(state, config, abstract_mesh(1, 4))
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, None)
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, None, None)
    assert specs["layers.mlp.up_proj.kernel"] == P(None, None, "model")
    # The same rules fit an optax state: its moments' paths end in the parameter names.
    import optax

    params = nnx.state(nnx.eval_shape(lambda: init_model(config)), nnx.Param)
    mesh = abstract_mesh(4, 2)
    adam = sharding.param_specs(jax.eval_shape(optax.adam(1e-3).init, params), config, mesh)[0]
    def flat(tree):
        return jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, P))
    assert flat(adam.mu) == flat(adam.nu) == flat(sharding.param_specs(params, config, mesh))
    assert adam.count == P()


def test_huginn_fused_projections_stay_replicated():
    config = preset("huginn-tiny")  # 4 heads = 4 kv heads, fused Wqkv and fc
    state = nnx.state(nnx.eval_shape(lambda: init_model(config)))
    specs = specs_by_name(state, config, abstract_mesh(2, 2))
    assert specs["core_block.attn.Wqkv.kernel"] == P()
    assert specs["core_block.mlp.fc.kernel"] == P()
    assert specs["core_block.attn.proj.kernel"] == P(None, "model", None)
    assert specs["core_block.attn.qk_bias"] == P(None, None, None, "model", None)
    assert specs["prelude.mlp.proj.kernel"] == P(None, "model", None)


@pytest.mark.parametrize("name", ["dense", "residual", "uniform", "kivi", "residual_vq"])
def test_cache_specs_every_format(name):
    """Every state leaf [G, N, B, K, S, ...] (codes, scales, α, KIVI's buffers) → batch over data, kv
    heads over model; lengths/overflow over data; replicated where an axis does not divide."""
    config = ouro_config()
    fmt = get_format(name, **({"residual_length": 32} if name == "kivi" else {}))
    cache = jax.eval_shape(lambda: init_cache(config, 4, 64, fmt))
    specs = sharding.cache_specs(cache, abstract_mesh(4, 2))
    leaves = jax.tree.leaves((specs.looped, specs.plain), is_leaf=lambda s: isinstance(s, P))
    assert len(leaves) == len(jax.tree.leaves((cache.looped, cache.plain))) > 0
    assert set(leaves) == {P(None, None, "data", "model")}
    assert specs.lengths == specs.overflow == P("data")
    specs = sharding.cache_specs(cache, abstract_mesh(8, 4))  # batch 4 over 8, 2 kv heads over 4
    assert set(jax.tree.leaves(specs.looped, is_leaf=lambda s: isinstance(s, P))) == {P(None, None, None, None)}
    assert specs.lengths == P(None)


def test_calib_specs():
    config = ouro_config()
    cache = jax.eval_shape(lambda: init_cache(config, 4, 64, get_format("residual")))
    calib = jax.eval_shape(lambda: default_calib(cache))
    specs = sharding.calib_specs(calib, abstract_mesh(4, 2), get_format("residual"))
    (rot,) = specs.looped
    assert rot.key_rot == rot.value_rot == P(None, None, "model")  # [G, N, K, D, D]
    sds = jax.ShapeDtypeStruct
    books = RVQCodebooks(sds((4, 1, 16, 4), np.float32), sds((4, 1, 16, 4), np.float32), sds((4, 1, 2, 32), np.float32))
    specs = sharding.calib_specs(CacheCalib((RVQCalib(books, books),)), abstract_mesh(4, 2), get_format("residual_vq"))
    (rvq,) = specs.looped
    assert rvq.k.scale == P(None, None, "model") and rvq.k.c1 == rvq.v.c2 == P()
    assert sharding.calib_specs(None, abstract_mesh(4, 2), get_format("residual")) is None
    over4 = sharding.calib_specs(calib, abstract_mesh(1, 4), get_format("residual"))
    assert over4.looped[0].key_rot == P()  # 2 kv heads over 4


def test_init_distributed_is_environment_driven():
    assert sharding.init_distributed({}) is False
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        sharding.init_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2"})


def all_gathers(hlo_text: str) -> list[tuple[str, int]]:
    """(result type, bytes) of every all-gather in compiled HLO text (`jit(f).lower(...).compile().as_text()`)."""
    itemsize = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
    out = []
    for line in hlo_text.splitlines():
        match = re.search(r"=\s*(\(?[^=]*?)\s+all-gather(?:-start)?\(", line)
        if not match:
            continue
        total = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
            total += itemsize.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        out.append((match.group(1).strip(), total))
    return out


def test_all_gathers_parses_hlo():
    hlo = ("  %all-gather.3 = f32[4,1,37,32]{3,2,1,0} all-gather(f32[2,1,37,32]{3,2,1,0} %x), dimensions={0}\n"
           "  %ag = (u8[8]{0}, bf16[2,2]{1,0}) all-gather-start(u8[4]{0} %a, bf16[1,2]{1,0} %b)\n"
           "  %add = f32[4]{0} add(f32[4]{0} %p, f32[4]{0} %q)\n")
    assert all_gathers(hlo) == [("f32[4,1,37,32]{3,2,1,0}", 4 * 37 * 32 * 4),
                                         ("(u8[8]{0}, bf16[2,2]{1,0})", 8 + 8)]


# ---- generation on 8 simulated devices (subprocess) ---------------------------------------------


def _run_case(config, fmt, mesh_text: str, prompts, check_hlo: bool) -> dict:
    """Greedy tokens on one device and on the mesh; the cache's and params' shardings; the decode
    step's all-gathers (from the very program that generated: compiled once, then handed to the Sampler)."""
    from rq_jax.sampling import Sampler, SamplingConfig

    model = init_model(config, seed=0)
    cfg = SamplingConfig(max_new_tokens=4)
    mesh = sharding.parse_mesh(mesh_text)
    single = Sampler(model, cfg, fmt)(prompts, max_len=MAX_LEN)
    sampler = Sampler(model, cfg, fmt, mesh=mesh)
    result = {}
    if check_hlo:
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.zeros((len(prompts), lengths.max()), np.int32)
        rows = sharding.batch_sharding(mesh, tokens.shape)
        state = sampler._prefill(sampler.params, sampler.calib, *sharding.put((tokens, lengths), rows),
                                 sampler._empty_cache(len(prompts), MAX_LEN, mesh).as_bits(),
                                 sharding.put(jax.random.key(0), sharding.replicated(mesh)))
        decode = sampler._decode.lower(sampler.params, sampler.calib, state).compile()
        sampler._decode = decode
        text = decode.as_text()
        result.update(all_gathers=all_gathers(text), max_len=MAX_LEN,
                      native_calls=sorted(set(re.findall(r'custom_call_target="(rq_cpu_\w+)"', text))),
                      native_shapes=sorted({m for m in re.findall(r"= \((f32\[[\d,]+\])[^)]*\) custom-call", text)}),
                      cache_bytes=sum(x.nbytes for x in jax.tree.leaves((state.cache.looped, state.cache.plain))))
    out = sampler(prompts, max_len=MAX_LEN)
    leaves = jax.tree.leaves((out.cache.looped, out.cache.plain))
    q = sampler.params["layers"]["self_attn"]["q_proj"]["kernel"].get_value()
    result.update(single=single.tokens.tolist(), mesh=out.tokens.tolist(),
                  cache_specs=sorted({str(x.sharding.spec) for x in leaves}),
                  cache_replicated=all(x.sharding.is_fully_replicated for x in leaves),
                  lengths_spec=str(out.cache.lengths.sharding.spec),
                  shard_shapes=sorted({(x.shape[2] // x.addressable_shards[0].data.shape[2],
                                        x.shape[3] // x.addressable_shards[0].data.shape[3]) for x in leaves}),
                  q_proj_spec=str(q.sharding.spec), q_proj_replicated=q.sharding.is_fully_replicated,
                  describe=sharding.describe(config, mesh, len(prompts)))
    return result


def _eval_case(config, fmt, mesh_text: str) -> dict:
    """The eval loop (`CacheScorer`) through `fmt` on one device and on the mesh: its scores."""
    from rq_jax.scoring import CacheScorer

    model = init_model(config, seed=0)
    tokens = np.random.default_rng(3).integers(1, config.vocab_size, (4, 12)).astype(np.int32)
    prefix, lengths = np.array([3, 5, 2, 4], np.int32), np.array([12, 9, 12, 7], np.int32)
    single = CacheScorer(model, fmt)(tokens, prefix, lengths)
    mesh = CacheScorer(model, fmt, mesh=sharding.parse_mesh(mesh_text))(tokens, prefix, lengths)
    return {"single": {k: np.asarray(v).tolist() for k, v in single._asdict().items()},
            "mesh": {k: np.asarray(v).tolist() for k, v in mesh._asdict().items()}}


def _worker() -> None:
    assert jax.device_count() == 8, jax.devices()
    start = time.perf_counter()
    results = {
        "dense": _run_case(ouro_config(), get_format("dense"), "data=4,model=2", PROMPTS, check_hlo=True),
        "residual": _run_case(ouro_config(), RESIDUAL, "data=4,model=2", PROMPTS, check_hlo=True),
        # 3 kv heads and 3 rows over data=2, model=2: heads, cache and rows replicated, the MLP split.
        "replicated": _run_case(ouro_config(heads=3, kv_heads=3), get_format("dense"), "data=2,model=2",
                                PROMPTS[:3], check_hlo=False),
    }
    results["eval"] = _eval_case(ouro_config(), RESIDUAL, "data=4,model=2")
    results["seconds"] = time.perf_counter() - start
    print("RESULT " + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def eight_devices() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
    try:
        proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the 8-device subprocess did not finish in {err.timeout} s:\n{err.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["dense", "residual", "replicated"])
def test_mesh_generation_matches_one_device(eight_devices, case):
    r = eight_devices[case]
    assert r["mesh"] == r["single"]


def test_mesh_eval_loop_matches_one_device(eight_devices):
    """The eval loop through a residual cache scores the same on data=4, model=2 as on one device."""
    single, mesh = eight_devices["eval"]["single"], eight_devices["eval"]["mesh"]
    for name in ("scored", "correct", "ref_correct", "agree", "out_of_range"):
        assert mesh[name] == single[name], name
    for name in ("nll", "ref_nll", "kl"):
        np.testing.assert_allclose(mesh[name], single[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["dense", "residual"])
def test_cache_is_split_as_specified(eight_devices, case):
    r = eight_devices[case]
    assert r["cache_specs"] == [str(P(None, None, "data", "model"))]
    assert r["lengths_spec"] == str(P("data"))
    assert r["shard_shapes"] == [[4, 2]]  # each device holds 1 of 4 rows and 1 of 2 kv heads
    assert r["q_proj_spec"] == str(P(None, None, "model"))


def test_replicated_fallback_is_reported(eight_devices):
    r = eight_devices["replicated"]
    assert r["cache_replicated"] and r["q_proj_replicated"] and r["shard_shapes"] == [[1, 1]]
    assert any("not divisible by model=2" in line for line in r["describe"])
    assert any("batch 3 not divisible by data=2" in line for line in r["describe"])


@pytest.mark.parametrize("case", ["dense", "residual"])
@pytest.mark.skipif(not cpu_kernels.available(), reason=f"native kernels: {cpu_kernels.unavailable_reason()}")
def test_native_kernel_runs_per_device_shard(eight_devices, case):
    """On the mesh the decode step's attention is the native kernel (`auto` on a CPU), and a packed write the
    native encoder, partitioned: the attention calls see each device's 1 of 4 rows and 1 of 2 kv heads
    (acc [1, 1, R, 32]), not the whole batch."""
    r = eight_devices[case]
    assert r["native_calls"] == (["rq_cpu_dense"] if case == "dense" else ["rq_cpu_encode", "rq_cpu_quant"])
    assert r["native_shapes"] and all(shape.startswith("f32[1,1,") for shape in r["native_shapes"]), r["native_shapes"]


@pytest.mark.parametrize("case", ["dense", "residual"])
def test_decode_step_never_gathers_the_cache(eight_devices, case):
    """Every all-gather in the compiled decode step moves per-token data (this step's K/V codes,
    scatter indices), far below the cache, and none has the cache's length in its shape."""
    r = eight_devices[case]
    for shape, nbytes in r["all_gathers"]:
        assert nbytes * 16 <= r["cache_bytes"], (shape, nbytes, r["cache_bytes"])
        dims = [int(d) for group in re.findall(r"\[([\d,]*)\]", shape) for d in group.split(",") if d]
        assert not any(d % r["max_len"] == 0 for d in dims), shape


if __name__ == "__main__":
    _worker()
