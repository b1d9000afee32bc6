"""`ops.warmup.warm_up_prefill` compiles every kernel variant a layer's prefill steps launch: each launch of the prefill
and merge kernels is recorded with what Triton compiles a kernel for (its compile-time arguments, and of the other
arguments the properties it specializes on: integers equal to 1, divisible by 16, wider than 32 bits; pointers'
16-byte alignment and dtypes), and the steps' variants must all be among the warm-up's. The steps split their keys
1, 2, 3 and 16 ways (the count follows the step's shape in serving), with 1 and 9 queries and a batch of 3 requests,
over a block table of another width than the warm-up's, as vLLM's split prefill plans the cached prefix
(`causal=False`, queries after the prefix). Before the kernels stopped specializing on the split count and the table's
row stride, the merge compiled one variant per power of two of the split count and the prefill one per table width
class (this test failed on both)."""
import pytest
import torch

from kvx_core.descriptors import BlockTable, SeqLens
from kvx_core.ops import dispatch
from kvx_core.ops.triton import merge, prefill
from kvx_core.ops.warmup import warm_up_prefill

from .helpers import filled_cache

HQ = 8  # 4 query heads per KV head over filled_cache's 2


def _unspecialized(kernel) -> set[str]:
    """The arguments `kernel` does not specialize on: a JITFunction (CUDA) keeps them per parameter, the interpreter's
    stand-in keeps the decorator's arguments (reading only the latter keyed them on CUDA: this test failed there)."""
    if hasattr(kernel, "params"):
        return {p.name for p in kernel.params if p.do_not_specialize}
    return set(kernel.kwargs.get("do_not_specialize", ()))


def _variant(kernel, args, kwargs) -> tuple:
    """What Triton compiles `kernel` for at this launch (its cache key, as far as the arguments decide it)."""
    free = _unspecialized(kernel)
    key = []
    for name, a in zip(kernel.arg_names, args, strict=False):
        if isinstance(a, torch.Tensor):
            key.append((name, a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append((name, type(a).__name__))
        elif name in free:
            key.append((name, "int", abs(a) >= 2**31))
        else:
            key.append((name, a == 1, a % 16 == 0, abs(a) >= 2**31))
    return (*key, *sorted(kwargs.items()))


@pytest.fixture
def launches(monkeypatch):
    """{kernel name: set of variants launched}, recorded while the kernels run."""
    seen: dict[str, set] = {"prefill": set(), "merge": set()}

    class Recorded:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                seen[self.name].add(_variant(self.kernel, args, kwargs))
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(prefill, "_prefill_kernel", Recorded(prefill._prefill_kernel, "prefill"))
    monkeypatch.setattr(merge, "_merge_kernel", Recorded(merge._merge_kernel, "merge"))
    return seen


@pytest.mark.parametrize("name, window, softcap", [("nvfp4", None, None), ("bf16", None, None), ("int4", 40, 30.0)])
def test_the_warm_up_compiles_what_prefill_steps_launch(name, window, softcap, device, kernels_here, launches):
    c = filled_cache(name, device, nb=16, bs=16, h=2, d=64)
    desc = c.descriptor(0)
    opts = dict(sm_scale=0.125, softcap=softcap, window=window, causal=False, queries_after=True)
    assert warm_up_prefill(desc, num_qo_heads=HQ, q_dtype=torch.bfloat16, **opts) == 2
    warmed = {k: set(v) for k, v in launches.items()}
    assert warmed["prefill"] and warmed["merge"]
    for v in launches.values():
        v.clear()
    g = torch.Generator().manual_seed(0)
    steps = [([1], [100]), ([9], [48]), ([1, 7, 3], [33, 80, 20])]
    for q_lens, prefixes in steps:
        for splits in (1, 2, 3, 16):
            qo = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
            ids = torch.randint(0, 16, (len(q_lens), 13), generator=g, dtype=torch.int32)
            lens = SeqLens(torch.tensor(prefixes, dtype=torch.int32).to(device))
            plan = dispatch.plan_prefill(qo, BlockTable.packed(ids.to(device)), lens, fmt=c.format,
                                         num_qo_heads=HQ, num_kv_heads=2, head_dim=64, block_size=16,
                                         q_dtype=torch.bfloat16, device=device, num_splits=splits, check=False,
                                         **opts)
            q = torch.randn(int(qo[-1]), HQ, 64, generator=g).to(torch.bfloat16).to(device)
            plan.run(q, desc, out=torch.empty_like(q), lse=torch.empty(q.shape[:2], device=device))
    for kernel, variants in launches.items():
        assert variants and variants <= warmed[kernel], (kernel, variants - warmed[kernel])


def test_no_warm_up_where_no_kernel_serves(device):
    """Pools the kernels do not address (here: a CPU machine without the interpreter's stand-in) compile nothing."""
    c = filled_cache("nvfp4", "cpu", nb=4, bs=16, h=2, d=64)
    if dispatch._kernel_device(torch.device("cpu")):
        pytest.skip("the kernels serve CPU pools here")
    assert warm_up_prefill(c.descriptor(0), num_qo_heads=HQ, q_dtype=torch.bfloat16) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4", "int4", "bf16"])
def test_after_the_warm_up_prefill_steps_compile_nothing_cuda(name):
    """On a GPU, Triton's own kernel caches: after `warm_up_prefill`, split prefill steps of other shapes, split
    counts and table widths add no compiled kernel."""
    c = filled_cache(name, "cuda", nb=64, bs=16, h=2, d=64)
    desc = c.descriptor(0)
    opts = dict(sm_scale=0.125, causal=False, queries_after=True)
    assert warm_up_prefill(desc, num_qo_heads=HQ, q_dtype=torch.bfloat16, **opts) == 2
    dev = torch.cuda.current_device()

    def compiled() -> tuple[int, int]:
        return tuple(len(k.device_caches[dev][0]) for k in (prefill._prefill_kernel, merge._merge_kernel))

    before = compiled()
    g = torch.Generator().manual_seed(0)
    for q_lens, prefixes in (([1], [900]), ([16], [1000]), ([3, 1, 7], [500, 1000, 64])):
        for hint in (None, 1024):  # the plan's own split choice (from the SMs), and unsplit
            qo = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
            table = BlockTable.packed(torch.randint(0, 64, (len(q_lens), 70), generator=g, dtype=torch.int32).cuda())
            plan = dispatch.plan_prefill(qo, table, SeqLens(torch.tensor(prefixes, dtype=torch.int32).cuda()),
                                         fmt=c.format, num_qo_heads=HQ, num_kv_heads=2, head_dim=64, block_size=16,
                                         q_dtype=torch.bfloat16, device="cuda", check=False, max_seq_len=hint, **opts)
            q = torch.randn(int(qo[-1]), HQ, 64, generator=g).to(torch.bfloat16).cuda()
            plan.run(q, desc, out=torch.empty_like(q), lse=torch.empty(q.shape[:2], device="cuda"))
    torch.cuda.synchronize()
    assert compiled() == before
