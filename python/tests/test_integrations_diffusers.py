"""qattn.integrations.diffusers: qattn's processors and its dispatcher backend in Hugging
Face diffusers.

Without a GPU (every test not named test_gpu_*): qattn's drop-in runs PyTorch's SDPA on
CPU tensors, so a model after apply() must give exactly what it gave before (qattn's
processors are diffusers' with one call changed; the dispatcher backend is the native
one on qattn's drop-in), every attention layer must call
qattn.scaled_dot_product_attention (counted), and restore() must bring back what was
there. Tiny randomly initialised UNet2DConditionModel, SD3Transformer2DModel,
FluxTransformer2DModel and AutoencoderKL, built from their constructors (no downloads).

On an sm_90 GPU (test_gpu_*, skipped elsewhere with the reason): the same models in fp16
or bf16 with and without qattn, every attention call under set_fallback("raise"), each
kernel call within the scheme's bounds and the output within the budget the model gives
(the bounds are stated with the GPU tests below). Needs torch, qattn._C and diffusers
(skipped without it).
"""

import os
import subprocess
import sys
import warnings
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
qattn = pytest.importorskip("qattn")
diffusers = pytest.importorskip("diffusers")

from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel  # noqa: E402
from diffusers.models import attention_dispatch as dispatch  # noqa: E402
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0  # noqa: E402

from qattn import sdpa  # noqa: E402
from qattn.integrations import diffusers as qattn_df  # noqa: E402

from gpu import sm90_missing  # noqa: E402
from plugin_checks import (  # noqa: E402
    assert_calls_within_bounds, cossim, kernel_calls_recorder, largest_allowed_error)

# On CPU every call falls back, with a QattnFallbackWarning once per reason: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::qattn.errors.QattnFallbackWarning")

SEED = 1234


@pytest.fixture(autouse=True)
def fresh_policy():
    """Each test starts in "warn" mode with no reason warned yet and the dispatcher's
    active backend as it was, and leaves them so."""
    previous = qattn.set_fallback("warn")
    active = dispatch._AttentionBackendRegistry._active_backend
    sdpa._warned.clear()
    yield
    qattn.set_fallback(previous)
    dispatch._AttentionBackendRegistry._active_backend = active
    sdpa._warned.clear()


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of qattn.scaled_dot_product_attention (the function the plug-in
    calls) and records the shapes."""
    seen = []
    real = qattn.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        seen.append((tuple(query.shape), tuple(key.shape)))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(qattn, "scaled_dot_product_attention", spy)
    return seen


def gen(seed=SEED):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=SEED):
    return torch.randn(shape, generator=gen(seed))


# ---- tiny models and one forward each ------------------------------------------------------


def tiny_unet(channels=(32, 64), heads=2):
    torch.manual_seed(SEED)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=channels, layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=heads, norm_num_groups=8,
    ).eval()


def unet_inputs(size=8, device="cpu", dtype=torch.float32):
    x = randn(2, 4, size, size, seed=1)
    ctx = randn(2, 7, 32, seed=2)
    return dict(sample=x.to(device, dtype), timestep=torch.tensor([10, 500], device=device),
                encoder_hidden_states=ctx.to(device, dtype))


def tiny_sd3(head_dim=8, heads=4):
    torch.manual_seed(SEED)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=32, caption_projection_dim=head_dim * heads,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16,
    ).eval()


def sd3_inputs(size=8, device="cpu", dtype=torch.float32):
    return dict(hidden_states=randn(2, 4, size, size, seed=3).to(device, dtype),
                encoder_hidden_states=randn(2, 6, 32, seed=4).to(device, dtype),
                pooled_projections=randn(2, 16, seed=5).to(device, dtype),
                timestep=torch.tensor([1.0, 700.0], device=device))


def tiny_flux(head_dim=16, heads=2, rope=(4, 6, 6)):
    torch.manual_seed(SEED)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
        num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=rope,
    ).eval()


def flux_inputs(n_img=16, n_txt=6, device="cpu", dtype=torch.float32):
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(n_img // 4.0),
                                         indexing="ij"), -1).reshape(-1, 3)
    return dict(hidden_states=randn(2, n_img, 4, seed=6).to(device, dtype),
                encoder_hidden_states=randn(2, n_txt, 32, seed=7).to(device, dtype),
                pooled_projections=randn(2, 16, seed=8).to(device, dtype),
                timestep=torch.tensor([0.3, 0.9], device=device),
                img_ids=img_ids.to(device), txt_ids=torch.zeros(n_txt, 3, device=device))


def tiny_vae():
    torch.manual_seed(SEED)
    return AutoencoderKL(block_out_channels=(32,), norm_num_groups=8, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",)).eval()


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample if hasattr(out, "sample") else out[0]


def processors(model):
    return list(model.attn_processors.values())


# ---- processors that call SDPA themselves ---------------------------------------------------


def test_unet_apply_replaces_every_processor_and_keeps_the_output(calls):
    unet = tiny_unet()
    originals = processors(unet)
    assert {type(p) for p in originals} == {AttnProcessor2_0} and len(originals) == 8
    inputs = unet_inputs()
    expect = run(unet, inputs)
    assert calls == [] and expect.abs().max() > 0

    report = qattn_df.apply(unet)
    assert report == {"processors": 8, "dispatcher": 0, "unchanged": {}}
    assert all(type(p) is qattn_df.QattnAttnProcessor for p in processors(unet))
    got = run(unet, inputs)
    assert torch.equal(got, expect)  # the same computation on CPU, through qattn's drop-in
    # self- and cross-attention (7 text tokens) of 4 transformer blocks: 3 at 8 x 8 latents
    # with head dim 16, the mid block's at 4 x 4 with head dim 32
    assert Counter(calls) == {((2, 2, 64, 16), (2, 2, 64, 16)): 3, ((2, 2, 64, 16), (2, 2, 7, 16)): 3,
                              ((2, 2, 16, 32), (2, 2, 16, 32)): 1, ((2, 2, 16, 32), (2, 2, 7, 32)): 1}

    assert qattn_df.restore(unet) == 8
    assert all(a is b for a, b in zip(processors(unet), originals))  # the same objects back
    calls.clear()
    assert torch.equal(run(unet, inputs), expect) and calls == []


def test_sd3_joint_attention(calls):
    model = tiny_sd3()
    assert {type(p) for p in processors(model)} == {JointAttnProcessor2_0}
    inputs = sd3_inputs()
    expect = run(model, inputs)
    report = qattn_df.apply(model)
    assert report == {"processors": 2, "dispatcher": 0, "unchanged": {}}
    assert all(type(p) is qattn_df.QattnJointAttnProcessor for p in processors(model))
    got = run(model, inputs)
    assert torch.equal(got, expect)
    # image tokens (8 / 2)^2 = 16 and text tokens 6 in one joint sequence
    assert calls == [((2, 4, 22, 8), (2, 4, 22, 8))] * 2
    assert qattn_df.restore(model) == 2
    assert {type(p) for p in processors(model)} == {JointAttnProcessor2_0}


def test_vae_attention_and_a_bare_attention_layer(calls):
    vae = tiny_vae()
    x = randn(1, 3, 16, 16, seed=9)
    with torch.no_grad():
        expect = vae.decode(vae.encode(x).latent_dist.mode()).sample
    assert qattn_df.apply(vae)["processors"] == 2  # the encoder's and the decoder's mid-block
    with torch.no_grad():
        got = vae.decode(vae.encode(x).latent_dist.mode()).sample
    assert torch.equal(got, expect) and len(calls) == 2

    torch.manual_seed(SEED)
    layer = Attention(query_dim=32, cross_attention_dim=24, heads=2, dim_head=16).eval()
    h, ctx = randn(2, 10, 32, seed=10), randn(2, 5, 24, seed=11)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0  # diffusers' (B, Nk) keep-mask, made additive by prepare_attention_mask
    with torch.no_grad():
        want = layer(h, ctx, attention_mask=mask)
        assert qattn_df.apply(layer)["processors"] == 1  # set_processor on the layer itself
        assert type(layer.processor) is qattn_df.QattnAttnProcessor
        have = layer(h, ctx, attention_mask=mask)
    assert torch.equal(have, want)
    assert calls[-1] == ((2, 2, 10, 16), (2, 2, 5, 16))


def test_shared_processor_stays_shared():
    unet = tiny_unet()
    shared = AttnProcessor2_0()
    unet.set_attn_processor(shared)
    qattn_df.apply(unet)
    mine = processors(unet)
    assert all(p is mine[0] for p in mine) and type(mine[0]) is qattn_df.QattnAttnProcessor
    qattn_df.restore(unet)
    assert all(p is shared for p in processors(unet))


def test_other_processors_are_left_alone_and_reported():
    unet = tiny_unet()
    names = list(unet.attn_processors)
    unet.set_attn_processor({n: AttnProcessor() if i == 0 else AttnProcessor2_0() for i, n in enumerate(names)})
    report = qattn_df.apply(unet)
    assert report == {"processors": 7, "dispatcher": 0, "unchanged": {"AttnProcessor": 1}}
    assert type(unet.attn_processors[names[0]]) is AttnProcessor
    assert qattn_df.apply(unet)["processors"] == 7  # applying twice changes nothing more


def test_pipeline_components(calls):
    class Pipe:  # what apply reads of a DiffusionPipeline: .components
        def __init__(self):
            self.components = {"unet": tiny_unet(), "vae": tiny_vae(), "text_encoder": torch.nn.Linear(4, 4),
                               "scheduler": object(), "tokenizer": None}

    pipe = Pipe()
    report = qattn_df.apply(pipe)
    assert report == {"processors": 8 + 2, "dispatcher": 0, "unchanged": {}}
    run(pipe.components["unet"], unet_inputs())
    assert len(calls) == 8
    assert qattn_df.restore(pipe) == 10
    with pytest.raises(TypeError):
        qattn_df.apply(object())


def test_a_diffusers_pipeline_end_to_end(calls):
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    torch.manual_seed(SEED)
    transformer = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                        num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=1000,
                                        norm_num_groups=8).eval()
    pipe = DiTPipeline(transformer=transformer, vae=tiny_vae(), scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)

    def images():
        return pipe(class_labels=[1, 3], num_inference_steps=2, output_type="pt",
                    generator=torch.Generator().manual_seed(SEED)).images

    expect = images()
    assert calls == []
    assert qattn_df.apply(pipe) == {"processors": 2 + 2, "dispatcher": 0, "unchanged": {}}
    got = images()
    assert torch.equal(got, expect)
    # 2 steps x 2 DiT layers (a classifier-free-guidance batch of 4), then the VAE decoder
    assert len(calls) == 2 * 2 + 1 and calls[0][0][0] == 4


# ---- the dispatcher backend -------------------------------------------------------------------


def test_register_backend_adds_the_name_to_the_dispatcher():
    assert qattn_df.register_backend() is True
    member = dispatch.AttentionBackendName("qattn")
    assert member.value == "qattn" and member is dispatch.AttentionBackendName.QATTN
    assert dispatch._AttentionBackendRegistry._backends[member] is qattn_df.dispatch_attention
    assert "qattn" in {x.value for x in dispatch.AttentionBackendName.__members__.values()}
    assert qattn_df.register_backend() is True  # idempotent
    assert list(dispatch.AttentionBackendName).count(member) == 1


def test_flux_apply_sets_the_dispatcher_backend(calls):
    model = tiny_flux()
    inputs = flux_inputs()
    expect = run(model, inputs)
    assert calls == [] and expect.abs().max() > 0
    report = qattn_df.apply(model)
    assert report == {"processors": 0, "dispatcher": 2, "unchanged": {}}
    member = dispatch.AttentionBackendName("qattn")
    assert all(p._attention_backend is member for p in processors(model))
    got = run(model, inputs)
    assert torch.equal(got, expect)
    # the dispatcher's (B, N, H, d) arrives as SDPA's (B, H, N, d): 6 text + 16 image tokens
    assert calls == [((2, 2, 22, 16), (2, 2, 22, 16))] * 2
    assert qattn_df.restore(model) == 2
    assert all(p._attention_backend is None for p in processors(model))
    calls.clear()
    run(model, inputs)
    assert calls == []


def test_flux_with_the_dispatchers_checks_on(monkeypatch, calls):
    qattn_df.register_backend()
    member = dispatch.AttentionBackendName("qattn")
    # a parallel config must reach the backend (and be refused), never be dropped silently
    assert {"_parallel_config", "enable_gqa", "attn_mask", "scale"} <= dispatch._AttentionBackendRegistry._supported_arg_names[member]
    monkeypatch.setattr(dispatch._AttentionBackendRegistry, "_checks_enabled", True)
    model = tiny_flux()
    inputs = flux_inputs()
    expect = run(model, inputs)
    qattn_df.apply(model)
    assert torch.equal(run(model, inputs), expect) and len(calls) == 2


def test_flux_without_the_dispatcher_is_reported_unchanged():
    report = qattn_df.apply(tiny_flux(), dispatcher=False)
    assert report == {"processors": 0, "dispatcher": 0, "unchanged": {"FluxAttnProcessor": 2}}


def test_context_parallel_processor_keeps_its_backend():
    model = tiny_flux()
    first = processors(model)[0]
    first._parallel_config = object()  # qattn's backend runs no context parallelism
    report = qattn_df.apply(model)
    assert report["dispatcher"] == 1 and report["unchanged"] == {"FluxAttnProcessor": 1}
    assert first._attention_backend is None


def test_dispatchers_own_switches_take_the_name(calls):
    qattn_df.register_backend()
    model = tiny_flux()
    inputs = flux_inputs()
    expect = run(model, inputs)
    with dispatch.attention_backend("qattn"):
        got = run(model, inputs)
    assert torch.equal(got, expect) and len(calls) == 2
    calls.clear()
    run(model, inputs)
    assert calls == []  # the context manager is left
    model.set_attention_backend("qattn")
    run(model, inputs)
    assert len(calls) == 2


def _native(**kwargs):
    return dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName.NATIVE](**kwargs)


def _dispatch_cases():
    b, nq, nk, d = 2, 9, 12, 16
    keep = torch.rand(b, nk, generator=gen(12)) > 0.3
    keep[:, 0] = True
    return {
        "plain": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 4, d, seed=1), value=randn(b, nk, 4, d, seed=2)),
        "causal": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 4, d, seed=1), value=randn(b, nk, 4, d, seed=2),
                       is_causal=True),
        "gqa": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 2, d, seed=1), value=randn(b, nk, 2, d, seed=2),
                    enable_gqa=True),
        "scale": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 4, d, seed=1), value=randn(b, nk, 4, d, seed=2),
                      scale=0.07),
        "2-D key mask": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 4, d, seed=1),
                             value=randn(b, nk, 4, d, seed=2), attn_mask=keep),
        "4-D float mask": dict(query=randn(b, nq, 4, d), key=randn(b, nk, 4, d, seed=1),
                               value=randn(b, nk, 4, d, seed=2), attn_mask=randn(b, 1, nq, nk, seed=3)),
    }


DISPATCH = _dispatch_cases()


@pytest.mark.parametrize("name", list(DISPATCH))
def test_dispatch_attention_matches_the_native_backend(name, calls):
    kwargs = DISPATCH[name]
    got = qattn_df.dispatch_attention(**kwargs)
    if name == "2-D key mask":  # read as (B, 1, 1, Nkv), as the native backend of 0.42 does
        kwargs = dict(kwargs, attn_mask=kwargs["attn_mask"][:, None, None, :])
    expect = _native(**kwargs)
    assert got.shape == expect.shape == kwargs["query"].shape
    assert torch.equal(got, expect)
    assert len(calls) == 1


def test_dispatch_attention_refuses_what_it_does_not_run():
    q = randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="context parallelism"):
        qattn_df.dispatch_attention(q, q, q, _parallel_config=object())
    with pytest.raises(ValueError, match="LSE"):
        qattn_df.dispatch_attention(q, q, q, return_lse=True)


def test_a_dispatcher_it_cannot_extend_leaves_the_processors(monkeypatch):
    monkeypatch.setattr(qattn_df, "_backend_member", None)

    class Unknown:  # a registry without the expected internals
        pass

    monkeypatch.setattr(dispatch, "_AttentionBackendRegistry", Unknown)
    with pytest.warns(RuntimeWarning, match="keep"):
        assert qattn_df.register_backend() is False
    unet = tiny_unet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = qattn_df.apply(unet)
        flux_report = qattn_df.apply(tiny_flux())
    assert report["processors"] == 8
    assert flux_report == {"processors": 0, "dispatcher": 0, "unchanged": {"FluxAttnProcessor": 2}}


def test_the_module_imports_without_diffusers():
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import qattn.integrations.diffusers as d\n"
        "for f in (d.register_backend, lambda: d.apply(__import__('torch').nn.Linear(2, 2))):\n"
        "    try:\n        f()\n    except ImportError:\n        print('ImportError')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["ImportError", "ImportError"]


# ---- on an sm_90 GPU ---------------------------------------------------------------------------
#
# The bounds (as in test_integrations_transformers.py). Each call that reaches qattn's
# kernel is checked against FP32 SDPA on its own inputs with the scheme's bounds (CosSim >=
# MIN_COSSIM, relative L1 <= MAX_REL_L1; tests/tolerances/sage2_8b.json; the checks live in
# plugin_checks.py). The model's
# output is checked against the same model without the plug-in with a bound the model
# itself gives: the output's CosSim when every attention output carries the largest error
# that bound allows one call, a random error of relative L2 size DELTA = sqrt(2 (1 -
# MIN_COSSIM)). How much a model passes on the attention's error differs by model (in these
# tiny ones the residual and skip paths carry most of the output), so a fixed number would
# be loose for one model and wrong for another; a wrong attention (layout, head mapping,
# joint-sequence split) moves the output far outside the budget.

_NO_GPU = sm90_missing()
gpu = pytest.mark.skipif(_NO_GPU is not None, reason=str(_NO_GPU))


@pytest.fixture
def kernel_calls(monkeypatch):
    """plugin_checks.kernel_calls_recorder: the calls that reach qattn's kernel."""
    return kernel_calls_recorder(monkeypatch)


def with_and_without(model, inputs, kernel_calls, monkeypatch, layers):
    expect = run(model, inputs)
    report = qattn_df.apply(model)
    with largest_allowed_error(monkeypatch, SEED):
        budget = run(model, inputs)
    assert kernel_calls == []
    qattn.set_fallback("raise")  # every call here is one qattn runs
    got = run(model, inputs)
    assert len(kernel_calls) == layers, report
    assert all(cs is not None for _, cs, _ in kernel_calls)  # no mask: every call checked
    assert_calls_within_bounds(kernel_calls)
    assert torch.isfinite(got).all()
    cs, floor = cossim(got, expect), cossim(budget, expect)
    assert floor < 1.0, "the budget run changed nothing: the output does not see the attention"
    assert cs >= floor, f"CosSim {cs:.8f} below the budget {floor:.8f}"
    return report


@gpu
def test_gpu_unet_fp16(kernel_calls, monkeypatch):
    unet = tiny_unet(channels=(64, 128), heads=2).to("cuda", torch.float16)  # head dims 32, 64
    inputs = unet_inputs(size=16, device="cuda", dtype=torch.float16)
    assert with_and_without(unet, inputs, kernel_calls, monkeypatch, 8)["processors"] == 8


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_sd3(dtype, kernel_calls, monkeypatch):
    model = tiny_sd3(head_dim=64, heads=2).to("cuda", dtype)
    inputs = sd3_inputs(size=16, device="cuda", dtype=dtype)
    assert with_and_without(model, inputs, kernel_calls, monkeypatch, 2)["processors"] == 2


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_flux(dtype, kernel_calls, monkeypatch):
    model = tiny_flux(head_dim=64, heads=2, rope=(16, 24, 24)).to("cuda", dtype)
    inputs = flux_inputs(n_img=64, n_txt=16, device="cuda", dtype=dtype)
    assert with_and_without(model, inputs, kernel_calls, monkeypatch, 2)["dispatcher"] == 2
