"""The torch layer without a GPU, on meta tensors: the custom op's schema and fake
implementation, torch.compile(fullgraph=True) tracing, the backward error and the
sageattn keyword handling. Needs torch (any build; CPU is enough) and qattn._C."""

import warnings

import pytest

qattn = pytest.importorskip("qattn")
torch = pytest.importorskip("torch")

from qattn import _C, ops  # noqa: E402


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_schema():
    schema = str(torch.ops.qattn.attention.default._schema)
    assert schema.startswith("qattn::attention(Tensor q, Tensor k, Tensor v, bool is_causal, float? scale")
    # The masks beyond causal, last and with defaults (test_masks.py has the rest).
    assert 'Tensor? kv_lengths=None' in schema and 'str alignment="bottom_right", ' in schema
    assert schema.endswith('Tensor? attn_mask=None) -> (Tensor, Tensor)'), schema


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fake_shapes(layout):
    if layout == "HND":
        q, k = meta(2, 8, 300, 72), meta(2, 2, 500, 72)
    else:
        q, k = meta(2, 300, 8, 72), meta(2, 500, 2, 72)
    o, lse = qattn.attention(q, k, k, is_causal=True, layout=layout, return_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32
    assert qattn.attention(q, k, k, layout=layout).shape == q.shape


def test_compile_fullgraph_traces():
    def f(q, k, v):
        o, lse = qattn.attention(q * 2, k, v, is_causal=True, return_lse=True)
        return o.float().sum(-1) + lse

    q, k = meta(2, 8, 300, 128), meta(2, 2, 300, 128)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, k)
    assert out.shape == (2, 8, 300)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("nq,nkv", [(300, 500), (500, 300)])
def test_compile_fullgraph_traces_both_alignments(alignment, nq, nkv):
    def f(q, k, v):
        o, lse = qattn.attention(q, k, v, is_causal=True, return_lse=True, layout="NHD",
                                 causal_alignment=alignment)
        return o, lse

    q, k = meta(2, nq, 8, 128), meta(2, nkv, 2, 128)
    o, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, k)
    assert o.shape == q.shape and o.is_contiguous() and lse.shape == (2, 8, nq)


def test_backward_gives_gradients_of_the_inputs_shapes():
    # The backward itself is tested in test_backward.py.
    q = meta(1, 4, 128, 64).requires_grad_(True)
    o = qattn.attention(q, meta(1, 4, 128, 64), meta(1, 4, 128, 64))
    assert o.requires_grad
    o.float().sum().backward()
    assert q.grad.shape == q.shape


def test_shape_errors_at_trace_time():
    q = meta(1, 8, 128, 64)
    with pytest.raises(qattn.QattnError, match="heads_q = 8 is not a multiple of heads_kv = 3"):
        qattn.attention(q, meta(1, 3, 128, 64), meta(1, 3, 128, 64))
    with pytest.raises(qattn.QattnError, match="dtype"):
        qattn.attention(q.float(), q.float(), q.float())
    with pytest.raises(qattn.QattnError, match="layout"):
        qattn.attention(q, q, q, layout="BSHD")
    with pytest.raises(qattn.QattnError, match="scale"):
        qattn.attention(q, q, q, scale=0.0)


def test_cpu_tensors_are_refused():
    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(qattn.QattnError, match="CUDA device"):
        qattn.attention(q, q, q)


def test_sageattn_keywords():
    q = meta(1, 300, 8, 128)
    with pytest.warns(UserWarning, match="pv_accum_dtype"):
        qattn.sageattn(q, q, q, tensor_layout="NHD", pv_accum_dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = qattn.sageattn(q, q, q, tensor_layout="NHD", is_causal=True, sm_scale=0.1,
                                return_lse=True, qk_quant_gran="per_warp", smooth_k=True)
    assert o.shape == q.shape and lse.shape == (1, 8, 300)


# ---- what the op hands the C ABI (built on CPU tensors; nothing is launched) ----------


def call_for(q, k, v, layout="HND", **kw):
    opts = dict(is_causal=False, scale=None, layout=layout, return_lse=False, granularity="per_thread")
    opts.update(kw)
    return ops._Call(q, k, v, **opts)


def test_call_arguments_hnd_and_nhd():
    q = torch.zeros(2, 8, 300, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 500, 64, dtype=torch.bfloat16)
    c = call_for(q, k, k, is_causal=True, return_lse=True, granularity="per_block")
    (qp, *qs), _, _, (op, *os_), lse, dtype, shape, causal, scale, gran = c.args
    assert qp == q.data_ptr() and qs == [8 * 300 * 64, 300 * 64, 64]  # no copy
    assert os_ == [8 * 300 * 64, 300 * 64, 64] and op == c.o.data_ptr()
    assert lse == c.lse.data_ptr() and c.lse.shape == (2, 8, 300)
    assert (dtype, shape, causal, gran) == (_C.DTYPE_BF16, (2, 8, 2, 300, 500, 64), 1, 2)
    assert scale == pytest.approx(1 / 8)
    assert c.ws_bytes > 0 and c.workspace.numel() == c.ws_bytes

    qn = torch.zeros(2, 300, 8, 64, dtype=torch.float16)  # NHD
    kn = torch.zeros(2, 500, 2, 64, dtype=torch.float16)
    c = call_for(qn, kn, kn, layout="NHD", scale=0.3)
    (_, sb, sh, sn) = c.args[0]
    assert (sb, sh, sn) == (300 * 8 * 64, 64, 8 * 64)
    assert c.args[5] == _C.DTYPE_FP16 and c.args[6] == (2, 8, 2, 300, 500, 64)
    assert c.args[8] == pytest.approx(0.3) and c.args[4] == 0


def test_call_without_a_mask_passes_the_abi_defaults():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    c = call_for(q, q, q, is_causal=True)
    assert c.mask == (0, -1, -1, _C.ALIGN_BOTTOM_RIGHT, 0, 0, 0, 0, 0, _C.MASK_NONE) and c.kv_lengths is None
    assert c.attn_mask is None


def test_call_mask_arguments():
    q = torch.zeros(3, 4, 100, 64, dtype=torch.bfloat16)
    k = torch.zeros(3, 2, 300, 64, dtype=torch.bfloat16)
    lengths = torch.tensor([7, 0, 300], dtype=torch.int32)
    c = call_for(q, k, k, is_causal=True, kv_lengths=lengths, window_left=64, window_right=0,
                 alignment="top_left")
    assert c.mask == (lengths.data_ptr(), 64, 0, _C.ALIGN_TOP_LEFT, 0, 0, 0, 0, 0, _C.MASK_NONE)  # int32, contiguous: no copy
    assert c.ws_bytes > 0
    # int64 is clamped to [0, Nkv] and converted (a value past int32 must not wrap).
    wide = torch.tensor([-5, 2**40, 123], dtype=torch.int64)
    c = call_for(q, k, k, kv_lengths=wide, window_left=-1, window_right=16)
    assert c.kv_lengths.dtype == torch.int32 and c.kv_lengths.tolist() == [0, 300, 123]
    assert c.mask == (c.kv_lengths.data_ptr(), -1, 16, _C.ALIGN_BOTTOM_RIGHT, 0, 0, 0, 0, 0, _C.MASK_NONE)
    # A strided view is made contiguous: the C ABI reads B consecutive int32.
    strided = torch.tensor([1, 9, 2, 9, 3, 9], dtype=torch.int32)[::2]
    c = call_for(q, k, k, kv_lengths=strided)
    assert c.kv_lengths.is_contiguous() and c.kv_lengths.tolist() == [1, 2, 3]
    assert c.mask[0] == c.kv_lengths.data_ptr() != strided.data_ptr()


def test_call_refuses_bad_mask_arguments():
    q = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)
    for kw, match in ((dict(window_left=-2), "window_left = -2"),
                      (dict(window_right=2**31), "window_right = 2147483648"),
                      (dict(window_left=1.0), "window_left = 1.0"),
                      (dict(alignment="center"), "alignment = 'center'"),
                      (dict(kv_lengths=torch.zeros(2)), "kv_lengths.dtype = torch.float32"),
                      (dict(kv_lengths=torch.zeros(4, dtype=torch.int32)), r"allowed: \(2,\)")):
        with pytest.raises(qattn.QattnError, match=match):
            call_for(q, q, q, **kw)


def test_call_pads_rows_to_multiples_of_8():
    q = torch.randn(1, 4, 100, 36).to(torch.bfloat16)
    c = call_for(q, q, q)
    assert c.q.shape == (1, 4, 100, 40) and torch.equal(c.q[..., :36], q)
    assert (c.q[..., 36:] == 0).all()
    assert c.args[6][-1] == 40
    assert c.args[8] == pytest.approx(1 / 36 ** 0.5)  # the caller's d, not the padded one
    o, _ = c.outputs()
    assert o.shape == q.shape and o.is_contiguous()


def test_call_copies_only_what_the_abi_cannot_take():
    base = torch.zeros(1 + 4 * 64 * 64, dtype=torch.bfloat16)
    misaligned = base[1:].view(1, 4, 64, 64)  # 2 bytes past a 16-byte boundary
    c = call_for(misaligned, misaligned, misaligned)
    assert c.q.data_ptr() % 16 == 0 and c.q.data_ptr() != misaligned.data_ptr()
    nhd = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    view = nhd.transpose(1, 2)  # HND view of NHD memory: legal strides, no copy
    c = call_for(view, view, view)
    assert c.q.data_ptr() == nhd.data_ptr()
    assert c.args[0][1:] == (64 * 4 * 64, 64, 4 * 64)


def test_call_copies_expanded_inputs():
    # K/V broadcast over the query heads (stride 0) must be copied, not rejected: the C
    # ABI takes positive strides only.
    q = torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16).expand(1, 4, 64, 64)
    c = call_for(q, kv, kv)
    assert c.k.stride(1) > 0 and c.k.data_ptr() != kv.data_ptr()
    assert all(s > 0 for s in c.args[1][1:])


def test_scale_that_vanishes_in_fp32_is_refused():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    # 3e38 is finite in FP32 but its product with log2(e), which the kernel uses, is not.
    for bad in (1e-50, 1e300, 3e38, -0.5, 0.0, float("inf")):
        with pytest.raises(qattn.QattnError, match="scale"):
            ops._check_inputs(q, q, q, "HND", bad, "per_thread")
    for good in (1e-30, 0.125, 2.0e38):
        ops._check_inputs(q, q, q, "HND", good, "per_thread")


# ---- scheme="sa3_nvfp4" without a GPU -----------------------------------------------


def test_sa3_schema_and_fake_shapes():
    schema = str(torch.ops.qattn.attention_sa3_nvfp4.default._schema)
    assert schema.startswith("qattn::attention_sa3_nvfp4(Tensor q, Tensor k, Tensor v, bool is_causal")
    q, k = meta(2, 8, 300, 128), meta(2, 2, 300, 128)
    o, lse = qattn.attention(q, k, k, is_causal=True, return_lse=True, scheme="sa3_nvfp4")
    assert o.shape == q.shape and lse.shape == (2, 8, 300) and lse.dtype == torch.float32

    def f(q, k, v):
        return qattn.attention(q, k, v, scheme="sa3_nvfp4")

    assert torch.compile(f, fullgraph=True)(q, k, k).shape == q.shape


def test_sa3_options_it_declines_are_named():
    q = meta(1, 4, 256, 128)
    k = meta(1, 4, 128, 128)
    with pytest.raises(qattn.QattnError, match="scheme = 'sa4'"):
        qattn.attention(q, k, k, scheme="sa4")
    with pytest.raises(qattn.QattnError, match="window_size, kv_lengths or attn_mask"):
        qattn.attention(q, k, k, window_size=(64, 0), scheme="sa3_nvfp4")
    with pytest.raises(qattn.QattnError, match="bottom_right"):
        qattn.attention(q, k, k, is_causal=True, scheme="sa3_nvfp4")  # top-left, Nq != Nkv
    qg = torch.empty(1, 4, 256, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with pytest.raises(qattn.QattnUnsupportedError, match="no backward"):
        qattn.attention(qg, k, k, scheme="sa3_nvfp4")


def test_sa3_call_passes_its_scheme():
    """The C ABI gets the scheme (its workspace is the SA3 family's, sized by the C
    library without a device), and its head-dim rule comes back named."""
    assert _C.SCHEME_SAGE2_8B == 0 and _C.SCHEME_SAGE3_NVFP4 == 1
    q = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    sa2 = call_for(q, q, q)
    sa3 = call_for(q, q, q, scheme=_C.SCHEME_SAGE3_NVFP4)
    assert (sa2.scheme, sa3.scheme) == (0, 1) and sa3.ws_bytes != sa2.ws_bytes
    q96 = torch.zeros(1, 4, 256, 96, dtype=torch.bfloat16)
    with pytest.raises(qattn.QattnError, match="head_dim"):
        call_for(q96, q96, q96, scheme=_C.SCHEME_SAGE3_NVFP4)
    with pytest.raises(qattn.QattnError, match="CUDA"):
        qattn.attention(q, q, q, scheme="sa3_nvfp4")  # CPU tensors: refused before any call


def test_precision_modes_pass_their_schemes():
    """precision= maps to the C ABI's schemes: "precise" needs no workspace, "auto" the
    SA2-8b one and the guard's maxima after it (sized by the C library, no device)."""
    assert (_C.SCHEME_PRECISE16, _C.SCHEME_SAGE2_8B_AUTO) == (2, 3)
    q = torch.zeros(2, 8, 300, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 500, 64, dtype=torch.bfloat16)
    fast = call_for(q, k, k)
    precise = call_for(q, k, k, scheme=_C.SCHEME_PRECISE16)
    auto = call_for(q, k, k, scheme=_C.SCHEME_SAGE2_8B_AUTO)
    assert precise.ws_bytes == 0
    # (B·Hq + B·Hkv) FP32 pairs after the SA2-8b workspace, each array 256-aligned.
    assert auto.ws_bytes == -(-fast.ws_bytes // 256) * 256 + 256 + 256
    q100 = torch.zeros(1, 2, 130, 100, dtype=torch.float16)  # padded to 104 by the layer
    assert call_for(q100, q100, q100, scheme=_C.SCHEME_PRECISE16).ws_bytes == 0


def test_precision_argument_is_checked_by_name():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(qattn.QattnError, match="precision = 'exact'; allowed: 'fast', 'auto', 'precise'"):
        qattn.attention(q, q, q, precision="exact")
    with pytest.raises(qattn.QattnError, match="attn_mask with is_causal=True; allowed: an attn_mask alone"):
        qattn.attention(q, q, q, precision="auto", is_causal=True,
                        attn_mask=torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(qattn.QattnError, match="per_thread"):
        qattn.attention(q, q, q, precision="precise", granularity="per_block")
    with pytest.raises(qattn.QattnError, match="scheme 'sa2_8b'"):
        qattn.attention(q, q, q, precision="precise", scheme="sa3_nvfp4")
    qg = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with pytest.raises(qattn.QattnUnsupportedError, match="no backward"):
        qattn.attention(qg, qg, qg, precision="auto")
    with pytest.raises(qattn.QattnError, match="CUDA"):
        qattn.attention(q, q, q, precision="precise")  # CPU tensors: refused before any call


def test_precision_ops_trace_on_meta_tensors():
    """The op of the two modes has a fake implementation: shapes without a device, in
    both layouts, with the LSE."""
    q = torch.empty(2, 8, 300, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 500, 64, dtype=torch.bfloat16, device="meta")
    for mode in ("auto", "precise"):
        o, lse = qattn.attention(q, k, k, is_causal=True, return_lse=True, precision=mode,
                                 window_size=(100, 0))
        assert o.shape == q.shape and lse.shape == (2, 8, 300) and lse.dtype == torch.float32
        o = qattn.attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2),
                            layout="NHD", precision=mode)
        assert o.shape == (2, 300, 8, 64)
        mask = torch.ones(2, 1, 300, 500, dtype=torch.bool, device="meta")
        o = qattn.attention(q, k, k, attn_mask=mask, precision=mode)
        assert o.shape == q.shape


def test_set_precision_routes_the_sdpa_drop_in(monkeypatch):
    """qattn.set_precision: the mode of the SDPA drop-in's inference calls, with or without
    an attn_mask; training calls keep "fast". Checked on meta tensors, which take qattn's
    ops (the op a call reaches is recorded)."""
    assert qattn.get_precision() == "fast"
    with pytest.raises(ValueError, match="'fast' \\(the default\\), 'auto' or 'precise'"):
        qattn.set_precision("exact")
    seen = []
    real = ops.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("precision", "fast"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "attention", spy)
    q = torch.empty(1, 4, 128, 64, dtype=torch.bfloat16, device="meta")
    previous = qattn.set_precision("auto")
    try:
        assert previous == "fast" and qattn.get_precision() == "auto"
        assert qattn.scaled_dot_product_attention(q, q, q, is_causal=True).shape == q.shape
        mask = torch.ones(128, 128, dtype=torch.bool, device="meta")
        qattn.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        qg = q.detach().requires_grad_()
        qattn.scaled_dot_product_attention(qg, qg, qg)
    finally:
        qattn.set_precision(previous)
    assert seen == ["auto", "auto", "fast"]


def test_precision_environment_variable():
    import os
    import subprocess
    import sys

    env = {**os.environ, "QATTN_PRECISION": "precise"}
    out = subprocess.run([sys.executable, "-c", "import qattn; print(qattn.get_precision())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "precise"
    env["QATTN_PRECISION"] = "exact"
    bad = subprocess.run([sys.executable, "-c", "import qattn"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "QATTN_PRECISION = 'exact'" in bad.stderr


def test_using_precision_is_scoped_to_its_thread():
    """qattn.using_precision: the mode inside the block, nested blocks restore theirs, and
    another thread keeps the process's mode meanwhile."""
    import threading

    assert qattn.get_precision() == "fast"
    seen = {}
    with qattn.using_precision("auto"):
        assert qattn.get_precision() == "auto"
        with qattn.using_precision("precise"):
            assert qattn.get_precision() == "precise"
        assert qattn.get_precision() == "auto"
        t = threading.Thread(target=lambda: seen.setdefault("other", qattn.get_precision()))
        t.start()
        t.join()
    assert seen["other"] == "fast" and qattn.get_precision() == "fast"
    with pytest.raises(ValueError, match="'fast' \\(the default\\), 'auto' or 'precise'"):
        with qattn.using_precision("exact"):
            pass


# ---- V narrower than Q·K (MLA-style head dims) ------------------------------------------


def test_narrower_v_fake_shapes_and_call_arguments():
    q, k, v = meta(2, 8, 300, 192), meta(2, 2, 500, 192), meta(2, 2, 500, 128)
    o, lse = qattn.attention(q, k, v, return_lse=True)
    assert o.shape == (2, 8, 300, 128) and lse.shape == (2, 8, 300)
    # What the C ABI gets: Q and K at 192, V and O at 128 (head_dim_v), no copies.
    qc, kc, vc = (torch.zeros(t.shape, dtype=torch.bfloat16) for t in (q, k, v))
    c = call_for(qc, kc, vc)
    assert c.args[6] == (2, 8, 2, 300, 500, 192) and c.head_dim_v == 128
    assert c.v.data_ptr() == vc.data_ptr() and c.o.shape == (2, 8, 300, 128)
    assert c.ws_bytes > 0
    # Rows padded to multiples of 8 on both sides: d 100 -> 104, d_v 36 -> 40.
    qp, vp = torch.randn(1, 4, 64, 100).to(torch.bfloat16), torch.randn(1, 4, 64, 36).to(torch.bfloat16)
    c = call_for(qp, qp, vp)
    assert c.args[6][-1] == 104 and c.head_dim_v == 40 and c.v.shape[-1] == 40
    assert (c.v[..., 36:] == 0).all()
    o, _ = c.outputs()
    assert o.shape == (1, 4, 64, 36) and o.is_contiguous()
    # The same padded width on both sides: head_dim_v stays 0 (V's rows are Q's width).
    c = call_for(qp, qp, torch.zeros(1, 4, 64, 98, dtype=torch.bfloat16))
    assert c.head_dim_v == 0 and c.outputs()[0].shape == (1, 4, 64, 98)


def test_narrower_v_limits():
    q = meta(1, 4, 128, 64)
    with pytest.raises(qattn.QattnError, match="fewer channels than k"):
        qattn.attention(q, q, meta(1, 4, 128, 128))  # wider V
    # A training call: SageBwd takes one head dim.
    qg = meta(1, 4, 128, 128).requires_grad_(True)
    with pytest.raises(qattn.QattnUnsupportedError, match="fewer channels"):
        qattn.attention(qg, meta(1, 4, 128, 128), meta(1, 4, 128, 64))
    # The C ABI names what runs it: the 16-bit ("precise") and SageAttention3 families
    # take V of Q's head dim only.
    qc, vc = torch.zeros(1, 4, 64, 128, dtype=torch.bfloat16), torch.zeros(1, 4, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(qattn.QattnError, match="head_dim_v = 64, head_dim = 128"):
        call_for(qc, qc, vc, scheme=_C.SCHEME_PRECISE16)


def test_drop_in_takes_narrower_v_for_inference_only(monkeypatch):
    from qattn import sdpa
    monkeypatch.setattr(sdpa, "_device_runs_qattn", lambda *args: True)
    q, v = meta(1, 8, 128, 192), meta(1, 8, 128, 128)
    assert sdpa._decline(q, q, v, None, 0.0, False, None, False) is None
    qg = meta(1, 8, 128, 192).requires_grad_(True)
    assert sdpa._decline(qg, q, v, None, 0.0, False, None, False)[0] == "backward value head_dim"
    assert sdpa._decline(q, q, meta(1, 8, 128, 256), None, 0.0, False, None, False)[0] == "shape"
