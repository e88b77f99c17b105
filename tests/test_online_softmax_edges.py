"""Edge cases of the row softmaxes: masked tiles and rows, NaN and +inf, any rank, grids past
CUDA's limits, and inputs refused before any launch.

Every answer is torch.softmax's, NaN where torch's is NaN (``support.assert_close`` requires the
same NaN pattern and float64 accuracy elsewhere). The interpreter runs the online kernel and the
one-pass row kernel; the split-row kernel and the CUDA limits exist only on a GPU (``needs_gpu``).
"""

from __future__ import annotations

import types

import pytest
import torch

import online_softmax as osm
from online_softmax import OnlineSoftmax, online_softmax, online_softmax_backward, row_softmax
from support import ON_GPU, assert_close, needs_gpu, randn

INF = float("inf")
NAN = float("nan")

# Rows of 37 columns read in column steps of 8: tiles [0, 8), [8, 16), ..., [32, 37) (ragged last).
D2, STEP = 37, 8


def planted_rows(dtype=torch.float32) -> torch.Tensor:
    """(2, 12, 37) logits; row r of each batch element is the case below (batch 1 shifted by 3).

    Whole tiles of -inf first, in the middle, last (the ragged one), and all but one tile;
    a row of only -inf (NaN, as torch); NaN inside a tile of -inf (before any finite logit, where
    a running max that skips NaN would drop it); NaN among finite logits; +inf once, twice in two
    tiles, and beside -inf (torch gives NaN for every row holding NaN or +inf).
    """
    x = randn((2, 12, D2), torch.float32, seed=60, scale=3.0)
    x[:, 0, :STEP] = -INF  # first tile masked
    x[:, 1, 2 * STEP:3 * STEP] = -INF  # a middle tile masked
    x[:, 2, 4 * STEP:] = -INF  # the ragged last tile masked
    x[:, 3, :] = -INF
    x[:, 3, 3 * STEP + 1] = 0.25  # one live logit in the fourth tile: exactly 1 there
    x[:, 4, :] = -INF  # all -inf: NaN
    x[:, 5, :2 * STEP] = -INF
    x[:, 5, 3] = NAN  # NaN among -inf, in the first tile
    x[:, 6, 20] = NAN  # NaN among finite logits
    x[:, 7, 30] = INF
    x[:, 8, 1], x[:, 8, 33] = INF, INF  # +inf in the first and the last tile
    x[:, 9, :] = -INF
    x[:, 9, 12] = INF  # +inf among -inf: torch gives NaN (inf - inf)
    x[:, 10, :STEP] = -INF
    x[:, 10, 4 * STEP:] = -INF  # first and last tiles masked, middle live
    x[1] = x[1].roll(3, dims=0)  # rows land in other row tiles of the online kernel
    return x.to(dtype)


# name -> softmax over the last dimension of a 3-D x: the kernel and tiling it exercises.
KERNELS = {
    "online 4x8": lambda x: online_softmax(x, 4, STEP),  # row tiles of 4, column steps of 8
    "online 1x8": lambda x: online_softmax(x, 1, STEP),
    "online 16x64": lambda x: online_softmax(x, 16, 64),  # one tile holds everything
    "row_softmax one-pass": row_softmax,  # softmax_row_kernel: the whole row in one program
    "row_softmax BLOCK_SIZE=8": lambda x: row_softmax(x, STEP),  # online tiles of 1 x 8
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_masked_tiles_nan_and_inf_as_torch(kernel, dtype):
    x = planted_rows(dtype)
    want = torch.softmax(x, dim=-1)
    assert torch.isnan(want[0, 4:10]).all() and not torch.isnan(want[0, [0, 1, 2, 3, 10, 11]]).any()
    out = KERNELS[kernel](x)
    assert_close(out, torch.softmax(x.double(), dim=-1), want)
    assert (out[0, 3, 3 * STEP + 1] == 1).all() and (out[0, 3, :3 * STEP] == 0).all()


def torch_grads(x, dy):
    """torch autograd's gradient of softmax(x) . dy in float64 (the reference) and float32 (its error)."""
    grads = []
    for dtype in (torch.float64, torch.float32):
        leaf = x.to(dtype).requires_grad_()
        torch.softmax(leaf, dim=-1).backward(dy.to(dtype))
        grads.append(leaf.grad)
    return grads


@pytest.mark.parametrize("op", ["online_softmax", "OnlineSoftmax.apply", "row_softmax"])
def test_masked_rows_gradient_as_torch(op):
    """Backward through masked tiles: weight-0 logits get gradient 0, a NaN row gets NaN, as torch."""
    x = planted_rows()[:, [0, 1, 2, 4, 10]]
    dy = randn(x.shape, torch.float32, seed=61)
    fn = {"online_softmax": lambda t: online_softmax(t, 4, STEP), "OnlineSoftmax.apply": lambda t: OnlineSoftmax.apply(t, 4, STEP),
          "row_softmax": row_softmax}[op]
    leaf = x.clone().requires_grad_()
    fn(leaf).backward(dy)
    assert_close(leaf.grad, *torch_grads(x, dy))


# ----------------------------------------------------------------------------------------------
# Any rank >= 1
# ----------------------------------------------------------------------------------------------
RANK_SHAPES = {"1-D": (13,), "2-D": (5, 13), "4-D": (2, 3, 2, 13), "5-D": (1, 2, 1, 3, 13),
               "9-D": (1, 2, 1, 1, 2, 1, 1, 3, 13), "10-D": (2,) + (1,) * 8 + (13,)}


@pytest.mark.parametrize("op", ["online_softmax", "row_softmax"])
@pytest.mark.parametrize("shape", list(RANK_SHAPES.values()), ids=list(RANK_SHAPES))
def test_any_rank(op, shape):
    x = randn(shape, torch.float32, seed=len(shape), scale=2.0)
    out = online_softmax(x, 2, 8) if op == "online_softmax" else row_softmax(x)
    assert out.shape == x.shape
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


def test_online_softmax_rank_4_strided():
    """A 4-D view that cannot fold its leading dimensions in place: the wrapper's reshape copies it."""
    x = randn((3, 4, 6, 10), torch.float32, seed=62).transpose(0, 1)
    out = online_softmax(x, 4, 8)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


# ----------------------------------------------------------------------------------------------
# Grids: the batch folded into axis 0, programs looping past the grid's cap
# ----------------------------------------------------------------------------------------------
def test_online_grid_folds_batch_into_axis_0():
    """The online grid is one axis of batch x row tiles, whatever the batch (axis 1 stops at 65535)."""
    _, n_tiles, grid = osm._online_grid(70_000, 33, 16)
    assert n_tiles == 70_000 * 3 and grid == (n_tiles,)
    _, n_tiles, grid = osm._online_grid(2**20, 2**14, 1)
    assert n_tiles == 2**34 and grid == (osm.GRID_0_LIMIT,)


@pytest.mark.parametrize("op", ["forward", "backward"])
def test_online_programs_loop_past_the_grid_cap(monkeypatch, op):
    """With the grid capped below the tile count (as at CUDA's 2^31 - 1), each program takes
    several tiles of several batch elements: 3 programs for 2 x 3 row tiles here."""
    monkeypatch.setattr(osm, "GRID_0_LIMIT", 3)
    assert osm._online_grid(2, 9, 4) == (3, 6, (3,))
    x = randn((2, 9, 21), torch.float32, seed=63, scale=2.0)
    if op == "forward":
        assert_close(online_softmax(x, 4, 8), torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    else:
        y, dy = torch.softmax(x, dim=-1), randn(x.shape, torch.float32, seed=64)
        dx = online_softmax_backward(y, dy, 4, 8)
        ref = [(t * (g - (t * g).sum(-1, keepdim=True))) for t, g in ((y.double(), dy.double()), (y, dy))]
        assert_close(dx, *ref)


@needs_gpu
def test_online_softmax_batch_past_65535_on_gpu():
    x = randn((70_000, 3, 5), torch.float32, seed=65, scale=2.0)
    leaf = x.clone().requires_grad_()
    out = online_softmax(leaf, 4, 8)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    dy = randn(x.shape, torch.float32, seed=66)
    out.backward(dy)
    assert_close(leaf.grad, *torch_grads(x, dy))


# ----------------------------------------------------------------------------------------------
# The split-row kernel (GPU only): masked chunks, NaN, +inf
# ----------------------------------------------------------------------------------------------
@needs_gpu
def test_split_row_masked_chunks_nan_and_inf_on_gpu():
    """200_000 columns: 32 programs per row of 8192 columns (chunk 24 ragged, 25 to 31 past the
    row). Whole chunks of -inf first, in the middle and last; rows of only -inf; NaN inside a chunk
    of -inf; +inf; very negative logits beside a chunk of -inf: each as torch."""
    n = 200_000
    chunk = 8192
    launch = osm._row_launch(9, n, n, torch.float32, torch.cuda.current_device(), 0)
    assert (launch.kernel, launch.block, launch.split) == ("split", chunk, 32)
    x = randn((9, n), torch.float32, seed=67, scale=3.0)
    x[0, :chunk] = -INF  # first chunk
    x[1, 5 * chunk:6 * chunk] = -INF  # a middle chunk
    x[2, 24 * chunk:] = -INF  # the last, ragged chunk
    x[3, :] = -INF  # NaN
    x[4, :] = -INF
    x[4, 7 * chunk + 5] = NAN  # NaN in a chunk of only -inf: max -inf there, the sum must carry it
    x[5, 100] = INF
    x[6, :] = -INF
    x[6, 3 * chunk] = 2.0  # one live logit: exactly 1
    x[7, 42] = NAN
    x[8] -= 1000.0  # very negative logits beside a chunk of only -inf: that chunk's zeros scale by 0, not exp(1000)
    x[8, 2 * chunk:3 * chunk] = -INF
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    assert out[6, 3 * chunk] == 1 and torch.isnan(out[[3, 4, 5, 7]]).all()


@pytest.mark.parametrize("frame_bytes", [16, 64, 128])
@pytest.mark.parametrize("groups", [0, 3], ids=["a group a row", "3 groups"])
@pytest.mark.parametrize("parts", [1, 2], ids=["parts1", "parts2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_kernel_on_rows_off_16_bytes_one_program_a_row(dtype, parts, groups, frame_bytes):
    """VEC > 1 (rows that do not start on 16 bytes: width 37, so row r starts 37 r elements in):
    chunks laid from the boundary before each row (of 16 bytes: the vector; or of FRAME values,
    64 or 128 bytes, whole vectors of which before the row are masked off), the neighbours'
    values read in weigh -inf. One program a row (SPLIT 1) is what the interpreter can run
    (programs there never wait for each other), a group a row or 3 groups looping over the rows;
    PARTS 2 (a count of programs that is no power of two rounds up): the combine step's slot past
    SPLIT must be masked off, not read from the next program's slots. The planted rows as torch."""
    x = planted_rows(dtype).reshape(-1, D2)
    y = torch.empty_like(x)
    vec = 16 // x.element_size()
    frame = frame_bytes // x.element_size()
    n_rows = x.shape[0]
    groups = groups or n_rows
    # Four a program, then a guard far above every logit: a slot past SPLIT read as a maximum would show.
    stats = torch.full((4 * groups + 8,), 1000.0, device=x.device)
    osm.softmax_split_row_kernel[(groups,)](
        x, y, stats, torch.zeros(2 * groups, dtype=torch.int32, device=x.device),
        n_rows, D2, D2, D2, groups,
        CHUNK=osm.next_power_of_2(D2 + frame - vec), SPLIT=1, PARTS=parts, VEC=vec, FRAME=frame)
    assert_close(y, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    assert (stats[4 * groups:] == 1000).all(), "the stats slots are four a program, whatever the rows"


@pytest.mark.parametrize("frame_bytes", [16, 128])
@pytest.mark.parametrize("width", [1, 3, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_kernel_on_rows_shorter_than_a_vector(dtype, width, frame_bytes):
    """VEC > 1 on rows that end before their first 16-byte boundary (width 3: row r starts 3 r
    elements in, and most rows hold no whole vector): each value is read and written once, and
    nothing past the rows is written. The wrapper never sends rows this short to the split
    kernel; a direct call must still be right."""
    n_rows = 16
    x = randn((n_rows, width), dtype, seed=71, scale=3.0)
    out = torch.full((n_rows * width + 32,), 7.0, dtype=dtype, device=x.device)
    y = out[:n_rows * width].view(n_rows, width)
    vec = 16 // x.element_size()
    frame = frame_bytes // x.element_size()
    osm.softmax_split_row_kernel[(5,)](  # 5 groups of one program: each loops over 3 or 4 rows
        x, y, torch.empty(4 * 5, device=x.device), torch.zeros(2 * 5, dtype=torch.int32, device=x.device),
        n_rows, width, width, width, 5, CHUNK=osm.next_power_of_2(width + frame - 1), SPLIT=1, PARTS=1, VEC=vec,
        FRAME=frame)
    assert_close(y, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    assert (out[n_rows * width:] == 7).all()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_long_rows_off_16_bytes_on_the_split_kernel_on_gpu(dtype):
    """Rows past the on-chip size of an odd width (50257 columns: each row starts at another
    offset from a 16-byte boundary) on the split kernel with chunks laid from the boundary: -inf
    in the first and last values, a row of only -inf, NaN, +inf next to a chunk's edge, as torch;
    and a view whose row stride differs from its width by a multiple of the vector (as its
    output's does) too."""
    n = 50257
    launch = osm._row_launch(6, n, n, dtype, torch.cuda.current_device(), 0)
    assert launch.kernel == "split" and launch.vec == 16 // dtype.itemsize
    x = randn((6, n), dtype, seed=68, scale=3.0)
    x[0, 0], x[0, -1] = -INF, -INF
    x[1, :] = -INF
    x[2, launch.block - 1] = INF
    x[3, 3] = NAN
    x[4, :] = -INF
    x[4, -1] = 1.0  # the row's only live value in its last chunk: exactly 1
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    assert torch.isnan(out[1:4]).all() and out[4, -1] == 1
    wide = randn((6, n + 16), dtype, seed=69, scale=3.0)
    view = wide[:, :n]
    assert osm._row_launch(6, n, n + 16, dtype, torch.cuda.current_device(), 0).vec > 1
    assert_close(row_softmax(view), torch.softmax(view.double(), dim=-1), torch.softmax(view, dim=-1))


@pytest.mark.parametrize("n,stride,kernel,split,chunk", [
    (50257, 50257, "split", 13, 4096), (50256, 50256, "split", 13, 4096), (65536, 65536, "split", 16, 4096),
    (50256, 50257, "online", 0, 0), (50257, 50258, "online", 0, 0),
    (65537, 65537, "split", 9, 8192), (151936, 151936, "split", 19, 8192), (128256, 128256, "split", 16, 8192)])
def test_long_16bit_rows_split_only_when_read_in_vectors(n, stride, kernel, split, chunk):
    """Rows whose loads and stores can both be whole vectors (all on 16-byte boundaries, or x's
    and y's rows equally far past one) take the split kernel, in as few programs as cover the row
    (151936: 19, not 32), of 4096 columns while that takes at most SPLIT_SHORT_PROGRAMS of them,
    else 8192; strides that shift x's rows against y's take the online tiles."""
    assert osm._split_suits_16bit(n, stride, torch.bfloat16) == (kernel == "split")
    if kernel == "split":
        assert osm._split_shape(n, osm._split_chunk_bytes(n, torch.bfloat16), torch.bfloat16) == (split, chunk)
    if ON_GPU:
        launch = osm._row_launch(4, n, stride, torch.bfloat16, torch.cuda.current_device(), 0)
        assert launch.kernel == kernel and (kernel == "online" or (launch.split, launch.block) == (split, chunk))


@pytest.mark.parametrize("n,split,chunk", [(50257, 16, 4096), (65536, 16, 4096), (128256, 16, 8192),
                                           (151936, 19, 8192), (262144, 32, 8192), (200_000, 32, 8192)])
def test_long_float32_rows_split_in_a_power_of_two_when_it_fills_three_quarters(n, split, chunk):
    """float32 rows: a power of two of programs where it leaves at most a quarter of them idle
    (50257 in 16 of 4096 columns, 13 needed), else as few as cover the row (151936 in 19 of 8192,
    not 32)."""
    assert osm._split_shape(n, osm._split_chunk_bytes(n, torch.float32), torch.float32) == (split, chunk)


@pytest.mark.parametrize("n_rows,block,rows", [(67108, 1024, 2), (131072, 512, 4), (256, 64, 2), (64, 16, 1),
                                           (1000, 8, 8), (5, 128, 1)])
def test_narrow_rows_pack_into_programs_while_every_sm_keeps_one(monkeypatch, n_rows, block, rows):
    """On a GPU (132 SMs here) the one-pass kernel takes up to ROW_BLOCK_VALUES values a program,
    in a power of two of rows, but never fewer programs than SMs where the rows allow."""
    monkeypatch.setattr(osm, "INTERPRET", False)
    monkeypatch.setattr(osm, "_device_properties", lambda index: types.SimpleNamespace(multi_processor_count=132))
    assert osm._row_block_rows(n_rows, block, 0) == rows


@needs_gpu
def test_unaligned_float32_rows_whose_copy_misses_the_split_capacity_on_gpu():
    """float32 rows not starting on 16 bytes are copied before the split kernel, and the copy's
    row stride (its width, 2457604: no multiple of 16) compiles another variant, which may hold
    fewer programs than the 301 this row needs (compiled by triton 3.9 for sm_90 it does, and the
    copy then takes the online tiles): whichever launch each gets, the answer is torch's."""
    big = randn((2, 2457616), torch.float32, seed=72, scale=3.0)
    view = big[:, 1:2457605]
    assert_close(row_softmax(view), torch.softmax(view.double(), dim=-1), torch.softmax(view, dim=-1))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_past_the_split_capacity_take_the_online_tiles_on_gpu(dtype):
    """A row needing more split programs than the device holds at once (8_000_001 columns) runs in
    online tiles rather than failing, as torch."""
    n = 8_000_001 if dtype == torch.bfloat16 else 8_000_000
    assert osm._row_launch(2, n, n, dtype, torch.cuda.current_device(), 0).kernel == "online"
    x = randn((2, n), dtype, seed=70, scale=3.0)
    assert_close(row_softmax(x), torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


@needs_gpu
def test_long_16bit_rows_off_16_bytes_take_the_online_tiles_in_place(monkeypatch):
    """A bf16 view whose width and stride suit the split kernel but whose data starts 2 bytes
    past a 16-byte boundary runs in online tiles on x itself, not on a copy."""
    wide = randn((3, 65536 + 8), torch.bfloat16, seed=70, scale=3.0)
    x = wide[:, 1:65537]
    assert osm._split_suits_16bit(65536, x.stride(0), x.dtype) and x.data_ptr() % 16
    seen = []
    online = osm._online_forward
    monkeypatch.setattr(osm, "_online_forward", lambda x3, *a: seen.append(x3.data_ptr()) or online(x3, *a))
    out = row_softmax(x)
    assert seen == [x.data_ptr()]
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_aligned_16bit_rows_on_the_split_kernel(dtype):
    """The split kernel on 16-bit rows (65536 columns: 8 programs a row): a row of only -inf, NaN,
    +inf in a later chunk, as torch."""
    n = 65536
    assert osm._row_launch(5, n, n, dtype, torch.cuda.current_device(), 0).kernel == "split"
    x = randn((5, n), dtype, seed=69, scale=3.0)
    x[1, :] = -INF
    x[2, 5 * 8192 + 7] = INF
    x[3, 3] = NAN
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    assert torch.isnan(out[1:4]).all()


@pytest.mark.parametrize("n_regs,warps,shared,expected", [
    (50, 4, 0, 9), (64, 8, 0, 4), (67, 8, 0, 3), (70, 4, 0, 7), (32, 4, 0, 16), (32, 4, 48 * 1024, 4)])
def test_resident_programs_round_registers_as_the_hardware_allocates(n_regs, warps, shared, expected):
    """Programs a SM holds at once: registers go to warps in units of 256 (50 a thread hold 56:
    36 warps of 4-warp programs, 9 of them, not the 10 that 50 x 128 into 65536 gives), then
    threads (2048) and shared memory (228 KiB) bound them too. The split kernel launches no more
    programs than this: one count too many could leave a group waiting on a program not yet running."""
    props = types.SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=228 * 1024,
                                  max_threads_per_multi_processor=2048)
    compiled = types.SimpleNamespace(n_regs=n_regs, metadata=types.SimpleNamespace(shared=shared))
    assert osm.resident_programs(compiled, warps, props) == expected


@pytest.mark.parametrize("n_regs,cap", [(70, 64), (72, 64), (65, 64), (64, None), (55, None), (73, None), (78, None)])
def test_split_register_cap_only_where_it_buys_a_program_for_little(n_regs, cap):
    """The split kernel is capped at 64 registers a thread where ptxas takes 65 to 72 (float32
    rows off 16 bytes take 70: 8 programs of 4 warps a SM capped, 7 not); never where it takes
    64 or fewer (a cap can raise what ptxas picks) nor far more (many values would spill)."""
    assert osm.split_registers(n_regs) == cap


@pytest.mark.parametrize("n,dtype,poorly", [
    (20000, torch.bfloat16, True), (16385, torch.float16, True), (30719, torch.bfloat16, True),
    (30720, torch.bfloat16, False), (32000, torch.bfloat16, False), (16384, torch.bfloat16, False),
    (12000, torch.bfloat16, False), (20000, torch.float32, False)])
def test_16bit_rows_that_fill_the_widest_one_pass_block_poorly(n, dtype, poorly):
    """16-bit rows in the one-pass kernel's widest block (32768 columns, a program a SM) that fill
    less than 15/16 of it go to the split kernel; narrower blocks and float32 rows stay."""
    assert osm._fills_poorly(n, dtype) is poorly


@pytest.mark.parametrize("n,stride,dtype,vec", [
    (65536, 65536, torch.bfloat16, 1), (20008, 20480, torch.bfloat16, 8), (50257, 50257, torch.bfloat16, 8),
    (65540, 65540, torch.float32, 4), (20000, 20008, torch.bfloat16, 8), (50256, 50257, torch.bfloat16, None)])
def test_split_rows_in_vectors_unless_triton_knows_they_are(n, stride, dtype, vec):
    """VEC 1 only where the width and the stride are multiples of 16 values (what Triton learns of
    an int); rows on 16 bytes of other widths (20008 bf16, 65540 float32) get VEC, so their masks
    hold whole vectors; None where x's rows sit against y's off a vector (50256 in 50257)."""
    assert osm._split_vec(n, stride, dtype) == vec


@pytest.mark.parametrize("n,stride,dtype,frame", [
    (50257, 50257, torch.bfloat16, 64), (17000, 17000, torch.bfloat16, 64), (65536, 65536, torch.bfloat16, 1),
    (50257, 50257, torch.float32, 32), (65536, 65544, torch.bfloat16, 1), (50257, 50321, torch.bfloat16, 64),
    (40000, 40000, torch.bfloat16, 1)])
def test_split_rows_framed_from_128_bytes_where_they_do_not_start_there(n, stride, dtype, frame):
    """Rows not all on 128-byte boundaries are laid from the one before each (64 bf16 or 32 float32
    values), where x's and y's rows (y's n apart) start equally far past one: not where every row
    starts on one (65536, 40000 bf16), nor where x's stride shifts them against y's (65544)."""
    assert osm._split_frame(n, stride, dtype) == frame


@pytest.mark.parametrize("dtype,major,hip,expected", [
    (torch.bfloat16, 9, False, True), (torch.float16, 10, False, True), (torch.bfloat16, 8, False, False),
    (torch.float32, 9, False, False), (torch.bfloat16, 9, True, False)])
def test_split_prefetch_for_16bit_rows_from_sm_90(monkeypatch, dtype, major, hip, expected):
    """The split kernel's L2 prefetch (a bulk prefetch: sm_90's PTX) on 16-bit rows of NVIDIA GPUs
    of compute capability 9 and later only; float32 rows, and ROCm (whose major numbers are not
    CUDA's), go without it."""
    monkeypatch.setattr(torch.version, "hip", "6.0" if hip else None)
    assert osm.split_prefetch(dtype, types.SimpleNamespace(major=major)) is expected


@needs_gpu
@pytest.mark.parametrize("n,dtype", [(50257, torch.bfloat16), (65536, torch.float16)])
def test_split_row_l2_prefetch_changes_no_value_on_gpu(monkeypatch, n, dtype):
    """Groups looping over more rows than there are groups, so each program prefetches its chunk
    of its next row (and the last rows ask for none past n_rows): planted -inf, NaN and +inf rows
    as torch, and the output bit for bit the same as without the prefetch."""
    n_rows = 400
    launch = osm._row_launch(n_rows, n, n, dtype, torch.cuda.current_device(), 0)
    assert launch.kernel == "split" and launch.programs // launch.split < n_rows
    assert launch.prefetch == (torch.cuda.get_device_capability()[0] >= 9)
    x = randn((n_rows, n), dtype, seed=73, scale=3.0)
    x[1, :] = -INF
    x[n_rows - 2, 5] = NAN
    x[n_rows - 1, n - 1] = INF
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    monkeypatch.setattr(osm, "split_prefetch", lambda dtype, props: False)
    osm.forget_row_launches()
    assert not osm._row_launch(n_rows, n, n, dtype, torch.cuda.current_device(), 0).prefetch
    assert torch.equal(row_softmax(x).view(torch.int16), out.view(torch.int16))  # bits: NaN too
    osm.forget_row_launches()


@needs_gpu
def test_poorly_filled_16bit_rows_split_and_off_16_bytes_in_one_pass_on_gpu(monkeypatch):
    """20000 bf16 columns take the split kernel (5 programs of 4096); a view of them starting 2
    bytes past a 16-byte boundary takes the one-pass kernel instead (not the online tiles), its
    L2 prefetch asking for rows that start off 16 bytes. Planted -inf, NaN, +inf as torch."""
    n = 20000
    launch = osm._row_launch(300, n, n, torch.bfloat16, torch.cuda.current_device(), 0)
    assert (launch.kernel, launch.split, launch.block) == ("split", 5, 4096)
    wide = randn((300, n + 8), torch.bfloat16, seed=74, scale=3.0)
    wide[1, 1:n + 1] = -INF
    wide[250, 7] = NAN
    wide[299, n] = INF
    seen = []
    one_pass = osm._one_pass_launch
    monkeypatch.setattr(osm, "_one_pass_launch", lambda *a: seen.append(a) or one_pass(*a))
    for x in (wide[:, :n], wide[:, 1:n + 1]):
        seen.clear()
        out = row_softmax(x)
        assert len(seen) == (x.data_ptr() % 16 != 0)
        assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


@needs_gpu
@pytest.mark.parametrize("n", [12000, 32000])
def test_one_pass_l2_prefetch_changes_no_value_on_gpu(monkeypatch, n):
    """16-bit rows in one program each, more rows than the device holds programs, so each asks L2
    for the row ``ahead`` on (none past n_rows): planted rows as torch, and the output bit for bit
    the one without the prefetch."""
    n_rows = 700
    launch = osm._row_launch(n_rows, n, n, torch.bfloat16, torch.cuda.current_device(), 0)
    assert launch.kernel == "row" and launch.rows == 1
    assert (launch.ahead > 0) == (torch.cuda.get_device_capability()[0] >= 9) and launch.ahead < n_rows
    x = randn((n_rows, n), torch.bfloat16, seed=75, scale=3.0)
    x[3, :] = -INF
    x[n_rows - 1, 0] = NAN
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))
    monkeypatch.setattr(osm, "row_prefetch", lambda *a: 0)
    osm.forget_row_launches()
    assert osm._row_launch(n_rows, n, n, torch.bfloat16, torch.cuda.current_device(), 0).ahead == 0
    assert torch.equal(row_softmax(x).view(torch.int16), out.view(torch.int16))
    osm.forget_row_launches()


@needs_gpu
@pytest.mark.parametrize("n,dtype", [(17000, torch.bfloat16), (45000, torch.float32)])
def test_split_rows_framed_from_128_bytes_on_gpu(n, dtype):
    """Rows on 16 bytes but not on 128, of widths no multiple of 16 values (17000 bf16, 45000
    float32), in frames of 128 bytes: the frame's values before a row and the row's first and
    last vectors as planted (-inf first and last, a row of only -inf, NaN, +inf at a chunk's
    edge), as torch; groups looping over rows."""
    n_rows = 300
    launch = osm._row_launch(n_rows, n, n, dtype, torch.cuda.current_device(), 0)
    assert launch.kernel == "split" and launch.frame == 128 // dtype.itemsize and launch.vec == 16 // dtype.itemsize
    x = randn((n_rows, n), dtype, seed=76, scale=3.0)
    x[0, 0], x[0, -1] = -INF, -INF
    x[1, :] = -INF
    x[2, launch.block - 1] = INF
    x[n_rows - 1, 3] = NAN
    out = row_softmax(x)
    assert_close(out, torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


@needs_gpu
def test_online_and_row_kernels_nan_and_inf_compiled():
    """The planted rows through every kernel compiled (the interpreter's NumPy max propagates NaN;
    a GPU's max skips it): the same NaN rows as torch."""
    x = planted_rows()
    for name, fn in KERNELS.items():
        assert_close(fn(x), torch.softmax(x.double(), dim=-1), torch.softmax(x, dim=-1))


# ----------------------------------------------------------------------------------------------
# Mixed devices, refused before any launch
# ----------------------------------------------------------------------------------------------
@needs_gpu
def test_cpu_and_cuda_tensors_mixed():
    y = torch.softmax(randn((2, 3, 5), torch.float32, seed=68), dim=-1)
    with pytest.raises(ValueError, match=r"dy is on cpu"):
        online_softmax_backward(y, y.cpu())
    with pytest.raises(ValueError, match=r"y is on cpu"):
        online_softmax_backward(y.cpu(), y)


def test_sparse_input_refused_by_name():
    x = randn((4, 6), torch.float32, seed=69).to_sparse()
    for fn in (row_softmax, online_softmax, OnlineSoftmax.apply):
        with pytest.raises(TypeError, match=r"x must be a dense \(strided\) tensor, got layout torch\.sparse_coo"):
            fn(x)
