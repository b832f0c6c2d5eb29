"""Sweep of diffusers' model classes through backend="tpu": every class diffusers exports that is
a model (`diffusers.ModelMixin`), built from a tiny config with random weights (no downloads),
run for a few steps of an Euler denoising loop that calls the compiled model, against eager.

    python bench/sweep_diffusers.py --jobs 2            # all classes, resumable
    python bench/sweep_diffusers.py --only UNet2DConditionModel AutoencoderKL   # rerun these

Per class: built (config + eager run), aot_eager ok (what torch itself compiles), tpu ok
(backend="tpu" with fallback="eager", as bench/sweep.py runs it: every step's output, the step
called on eager's input for that step, within rtol 1e-4 and atol 1e-4 x the largest output
magnitude), the ops that ran in PyTorch
(`tpuc.stats()["fallback_ops"]`: ops without a rule, and ops kept there by design such as an
unstable sort's tie order), max error, a short error, wall time. Results:
bench/results/sweep_diffusers.{json,md}.

Configs: a recipe per class where the generic shrink is not enough (RECIPES); otherwise the
class's own defaults shrunk generically (`shrink`: one layer per stack, 2 heads of 16, widths
of 32, small samples). Inputs come from the forward signature (`inputs`). A denoiser is called
as `model(x, t, *conditioning)` for STEPS steps of `x <- x - dt * out`; an autoencoder is called
as `model(x)` (encode + decode, posterior mode) and steps the same way.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_runner  # noqa: E402
from sweep_diffusers_configs import CONFIGS, TESTED  # noqa: E402

STEPS = 3
RTOL = 1e-4
ATOL_REL = 1e-4  # atol = ATOL_REL * the largest eager output magnitude
B = 1
TEXT = 6  # text tokens of conditioning
WIDTH = 32  # every big width is shrunk to this
HEADS, HEAD_DIM = 2, 16
SIDE = 8  # latent height and width
FRAMES = 3


def model_classes() -> list[str]:
    import diffusers
    import torch

    out = []
    for name in sorted(dir(diffusers)):
        if not name[:1].isupper() or name == "ModelMixin":
            continue
        try:
            c = getattr(diffusers, name)
        except Exception:  # noqa: BLE001 - an optional class that cannot import is skipped
            continue
        if inspect.isclass(c) and issubclass(c, torch.nn.Module) and issubclass(c, diffusers.ModelMixin):
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------------
# Configs


_LAYERS = (
    "num_layers",
    "num_single_layers",
    "n_layers",
    "num_mmdit_layers",
    "num_single_dit_layers",
    "num_refiner_layers",
    "n_refiner_layers",
    "mmdit_layers",
    "num_hidden_layers",
    "layers_per_block",
    "num_res_blocks",
    "depth",
    "approximator_layers",
    "transformer_layers_per_block",
    "num_blocks",
    "LFE_depth",
    "num_transformer_layers",
    "decoder_layers",
    "encoder_layers",
)
_HEADS = (
    "num_attention_heads",
    "n_heads",
    "num_kv_heads",
    "n_kv_heads",
    "num_key_value_heads",
    "num_key_value_attention_heads",
    "num_cross_attention_heads",
    "cross_attn_num_heads",
    "block_num_heads",
    "LFE_num_heads",
)
_HEAD_DIMS = ("attention_head_dim", "cross_attention_head_dim", "cross_attn_dim_head", "LFE_dim_head")
_ROPE_AXES = ("axes_dims_rope", "axes_dim_rope", "rope_axes_dim", "axes_dims")
_SIDES = ("sample_size", "sample_height", "sample_width", "pos_embed_max_size")
_KEEP = {"in_channels", "out_channels", "patch_size", "vocab_size", "codebook_size"}


def _rope_axes(n: int, total: int = HEAD_DIM) -> tuple:
    """`n` even rope axis sizes summing to `total`."""
    base = [total // n // 2 * 2] * n
    base[0] += total - sum(base)
    return tuple(base)


def shrink(cls) -> dict:
    """The class's own defaults, shrunk: one layer per stack, HEADS heads of HEAD_DIM, big widths
    down to WIDTH, sample sizes down to SIDE."""
    kw = {}
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        d = p.default
        if d is inspect.Parameter.empty or name in _KEEP or isinstance(d, bool):
            continue
        if name in _LAYERS and isinstance(d, int) and d > 1:
            kw[name] = 1
        elif name in _LAYERS and isinstance(d, tuple | list) and all(isinstance(i, int) for i in d):
            kw[name] = type(d)(1 for _ in d)
        elif name in _HEADS and isinstance(d, int) and d > HEADS:
            kw[name] = HEADS
        elif name in _HEAD_DIMS and isinstance(d, int) and d > HEAD_DIM:
            kw[name] = HEAD_DIM
        elif name in _ROPE_AXES and isinstance(d, tuple | list) and d:
            kw[name] = type(d)(_rope_axes(len(d)))
        elif name in _SIDES and isinstance(d, int) and d > SIDE:
            kw[name] = SIDE * 2 if name == "pos_embed_max_size" else SIDE
        elif name == "sample_frames" and isinstance(d, int):
            kw[name] = FRAMES
        elif name in ("hidden_size", "dim", "inner_dim", "model_dim") and isinstance(d, int) and d > WIDTH:
            kw[name] = HEADS * HEAD_DIM
        elif (
            isinstance(d, int)
            and d > WIDTH
            and (name.endswith(("_dim", "_channels", "_size")) or name in ("intermediate_size", "ffn_dim"))
            and not name.startswith(("max_", "num_embeds", "num_vq"))
            and "len" not in name
        ):
            kw[name] = WIDTH
        elif (
            name == "block_out_channels"
            and isinstance(d, tuple | list)
            and all(isinstance(i, int) for i in d)
        ):
            kw[name] = type(d)(min(c, 16 * 2**i) for i, c in enumerate(d))
        elif name in ("norm_num_groups", "groups", "attn_norm_num_groups") and isinstance(d, int) and d > 4:
            kw[name] = 4
    return kw


def unet2d_cond(**extra):
    return dict(
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=WIDTH,
        attention_head_dim=8,
        norm_num_groups=4,
        sample_size=SIDE,
        **extra,
    )


def vae2d(**extra):
    return dict(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=4,
        sample_size=16,
        **extra,
    )


@dataclass
class Recipe:
    config: dict = field(default_factory=dict)
    shrink: bool = True  # start from shrink(cls), then apply `config`
    x: str | None = None  # the input that is stepped
    x_shape: tuple | None = None  # its shape (None: from the class and config)
    t: str | None = "auto"  # the timestep input ("auto": the first known name in the signature)
    t_scale: float = 1000.0  # t runs over t_scale * (0.9, 0.6, 0.3)
    cond: dict = field(default_factory=dict)  # name -> shape (float randn) or a callable(model)
    fixed: dict = field(default_factory=dict)  # non-tensor keyword arguments
    # Wrappers of other models (Multi*ControlNet, MultiAdapter): makes the model from built
    # entries, `sub(name)` returning the model of another entry.
    model: object = None
    x_make: object = None  # a callable making x (integer token inputs), instead of randn


def _ids(n, axes=3):
    import torch

    return torch.zeros(n, axes)


# CogVideoX-style video transformers: 5 frames (2 latent frames) of SIDE x SIDE, TEXT text tokens.
_COGVIDEO = Recipe(
    dict(
        sample_frames=5,
        sample_height=SIDE,
        sample_width=SIDE,
        max_text_seq_length=TEXT,
        time_embed_dim=WIDTH,
    ),
    x_shape=(B, 2, 16, SIDE, SIDE),
)

# HunyuanDiT at 8x8 latents, TEXT tokens of both text encoders, the rotary table passed in.
_HUNYUAN_DIT = Recipe(
    dict(
        in_channels=4,
        patch_size=2,
        use_style_cond_and_image_meta_size=False,
        text_len=TEXT,
        text_len_t5=TEXT,
        cross_attention_dim=WIDTH,
        cross_attention_dim_t5=WIDTH,
        pooled_projection_dim=WIDTH,
    ),
    x_shape=(B, 4, SIDE, SIDE),
    cond={
        "encoder_hidden_states": (B, TEXT, WIDTH),
        "text_embedding_mask": lambda m: torch.ones(B, TEXT, dtype=torch.long),
        "encoder_hidden_states_t5": (B, TEXT, WIDTH),
        "text_embedding_mask_t5": lambda m: torch.ones(B, TEXT, dtype=torch.long),
    },
    fixed={
        "image_rotary_emb": (
            torch.randn((SIDE // 2) ** 2, HEAD_DIM),
            torch.randn((SIDE // 2) ** 2, HEAD_DIM),
        )
    },
)
# Its controlnet: the same inputs and a control latent (its multi-net wrapper: lists of them).
_HUNYUAN_DIT_CONTROL = replace(
    _HUNYUAN_DIT,
    config=_HUNYUAN_DIT.config | {"conditioning_channels": 4},
    cond=_HUNYUAN_DIT.cond | {"controlnet_cond": (B, 4, SIDE, SIDE)},
)


# Classes whose generic shrink and inputs need help. Shapes use B, TEXT, WIDTH, SIDE, FRAMES.
RECIPES: dict[str, Recipe] = {
    "UNet2DConditionModel": Recipe(
        unet2d_cond(), shrink=False, cond={"encoder_hidden_states": (B, TEXT, WIDTH)}
    ),
    "UNet2DModel": Recipe(
        dict(
            block_out_channels=(16, 32),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=4,
            attention_head_dim=8,
            sample_size=SIDE,
        ),
        shrink=False,
    ),
    "AutoencoderKL": Recipe(vae2d(), shrink=False, x_shape=(B, 3, 16, 16), t=None),
    "VQModel": Recipe(vae2d(), shrink=False, x_shape=(B, 3, 16, 16), t=None),
    "FluxTransformer2DModel": Recipe(
        dict(in_channels=16, joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH, guidance_embeds=True),
        x_shape=(B, 16, 16),
        t_scale=1.0,
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_projections": (B, WIDTH),
            "img_ids": lambda m: _ids(16),
            "txt_ids": lambda m: _ids(TEXT),
            "guidance": lambda m: _full(B, 3.5),
        },
    ),
    "DiTTransformer2DModel": Recipe(
        dict(norm_num_groups=4, sample_size=SIDE),
        cond={"class_labels": lambda m: torch.ones(B, dtype=torch.long)},
    ),
    "PixArtTransformer2DModel": Recipe(
        dict(cross_attention_dim=HEADS * HEAD_DIM, caption_channels=WIDTH),
        cond={"encoder_hidden_states": (B, TEXT, WIDTH)},
        fixed={"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}},
    ),
    "CogVideoXTransformer3DModel": _COGVIDEO,
    "ConsisIDTransformer3DModel": _COGVIDEO,  # CogVideoX's transformer with identity inputs
    "LTXVideoTransformer3DModel": Recipe(
        dict(in_channels=8, out_channels=8, caption_channels=WIDTH, cross_attention_dim=HEADS * HEAD_DIM),
        x_shape=(B, 2 * 4 * 4, 8),
        fixed={"num_frames": 2, "height": 4, "width": 4},
    ),
    "HunyuanDiT2DModel": _HUNYUAN_DIT,
    "QwenImageTransformer2DModel": Recipe(
        dict(in_channels=16, out_channels=4, joint_attention_dim=WIDTH),
        x_shape=(B, 16, 16),
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "encoder_hidden_states_mask": lambda m: torch.ones(B, TEXT),
        },
        fixed={"img_shapes": [[(1, 4, 4)]]},
        t_scale=1.0,
    ),
    # Flow-matching transformers whose pipelines pass t in [0, 1] (the model scales it by 1000 for
    # its sinusoidal embedding; t ~ 900 there makes arguments ~1e6, where one ulp of the
    # frequencies moves the phase by ~0.1 in any implementation).
    **{
        n: Recipe(t_scale=1.0)
        for n in (
            "AuraFlowTransformer2DModel",
            "ChromaTransformer2DModel",
            "Flux2Transformer2DModel",
            "Flux3Transformer2DModel",
            "Lumina2Transformer2DModel",
            "LongCatImageTransformer2DModel",
            "OvisImageTransformer2DModel",
        )
    },
    "SD3Transformer2DModel": Recipe(
        dict(caption_projection_dim=HEADS * HEAD_DIM),
        cond={"encoder_hidden_states": (B, TEXT, WIDTH), "pooled_projections": (B, WIDTH)},
    ),
    # Below: classes built from a pipeline test's config (CONFIGS) whose inputs the forward
    # signature does not tell: shapes follow those configs.
    # Audio token (de)tokenizers: (batch, tokens, hidden) / (batch, patches, window 2, acoustic 8).
    "AceStepAudioTokenDetokenizer": Recipe(x_shape=(B, 4, 32), t=None),
    "AceStepAudioTokenizer": Recipe(x_shape=(B, 3, 2, 8), t=None),
    # ACE-Step's condition encoder: TEXT text tokens, 8 lyric tokens, one packed 5-frame timbre
    # reference (order mask: all of batch 0), each with its mask.
    "AceStepConditionEncoder": Recipe(
        x="text_hidden_states",
        x_shape=(B, TEXT, 32),
        t=None,
        cond={
            "text_attention_mask": lambda m: torch.ones(B, TEXT, dtype=torch.long),
            "lyric_hidden_states": (B, 8, 32),
            "lyric_attention_mask": lambda m: torch.ones(B, 8, dtype=torch.long),
            "refer_audio_acoustic_hidden_states_packed": (B, 5, 8),
            "refer_audio_order_mask": lambda m: torch.zeros(B, dtype=torch.long),
        },
    ),
    # Anima's text conditioner: 8 T5 token ids as queries over TEXT Qwen3 states (its output
    # padding, min_sequence_length, shrunk to the query count).
    "AnimaTextConditioner": Recipe(
        dict(min_sequence_length=8),
        x="source_hidden_states",
        x_shape=(B, TEXT, 32),
        t=None,
        cond={"target_input_ids": lambda m: torch.randint(0, 32, (B, 8))},
    ),
    # Two text encoders' states (widths 16 and 32) projected for the language model.
    "AudioLDM2ProjectionModel": Recipe(
        x="hidden_states", x_shape=(B, TEXT, 16), t=None, cond={"hidden_states_1": (B, TEXT, 32)}
    ),
    # A UNet with two cross-attention streams (widths 8 and 16) on 4-channel latents.
    "AudioLDM2UNet2DConditionModel": Recipe(
        x_shape=(B, 4, 16, 16),
        cond={"encoder_hidden_states": (B, TEXT, 16), "encoder_hidden_states_1": (B, TEXT, 8)},
    ),
    # Stereo waveform; the test config's decoder input is widened for its pipeline: match the
    # encoder's latent (6 / 2 channels) to autoencode.
    "AutoencoderOobleck": Recipe({"decoder_input_channels": 3}, x_shape=(B, 2, 32), t=None),
    # A conditioning image at 2x the latents' side (its embedding downsamples once).
    "ControlNetModel": Recipe(
        {k: v for k, v in unet2d_cond().items() if k not in ("up_block_types", "sample_size")}
        | {"conditioning_embedding_out_channels": (8, 16)},
        shrink=False,
        cond={"encoder_hidden_states": (B, TEXT, WIDTH), "controlnet_cond": (B, 3, 2 * SIDE, 2 * SIDE)},
    ),
    # Bria FIBO 2: text features come as one bundle for its Perceiver plus one per injection
    # block (one injection, into the second of two layers); gist-token counts scaled down.
    "BriaFibo2Transformer2DModel": Recipe(
        dict(
            n_layers=2,
            injection_layer_ids=(1,),
            min_num_gist_tokens=4,
            max_num_gist_tokens=8,
            gist_step=4,
            gist_min_text_len=4,
            gist_max_text_len=16,
        ),
        x_shape=(B, 32, SIDE, SIDE),
        t_scale=1.0,
        cond={"encoder_hidden_states": (B, 2, TEXT, 32)},
    ),
    # ControlNet-Union (SDXL's): the same UNet, one control image of 6 control types, a narrow
    # control transformer, its control-type embedding sized by addition_time_embed_dim.
    "ControlNetUnionModel": Recipe(
        {k: v for k, v in unet2d_cond().items() if k not in ("up_block_types", "sample_size")}
        | {
            "conditioning_embedding_out_channels": (8, 16),
            "num_trans_channel": 16,
            "num_trans_head": 2,
            "num_proj_channel": 16,
            "addition_time_embed_dim": 8,
        },
        shrink=False,
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "controlnet_cond": lambda m: [torch.randn(B, 3, 2 * SIDE, 2 * SIDE)],
            "control_type": lambda m: torch.tensor([[1.0, 0, 0, 0, 0, 0]]),
        },
        fixed={"control_type_idx": [0]},
    ),
    # QwenImage's transformer inputs plus a control latent of the sample's shape.
    "QwenImageControlNetModel": Recipe(
        x_shape=(B, 16, 16),
        cond={
            "controlnet_cond": (B, 16, 16),
            "encoder_hidden_states": (B, TEXT, 16),
            "encoder_hidden_states_mask": lambda m: torch.ones(B, TEXT),
        },
        fixed={"img_shapes": [[(1, 4, 4)]]},
        t_scale=1.0,
    ),
    "SanaControlNetModel": Recipe(
        x_shape=(B, 4, SIDE, SIDE),
        cond={"encoder_hidden_states": (B, TEXT, 8), "controlnet_cond": (B, 4, SIDE, SIDE)},
    ),
    # CLIP image embedding prior: (batch, embedding_dim) sample, text states of 77 tokens.
    "PriorTransformer": Recipe(
        x_shape=(B, 32), cond={"proj_embedding": (B, 32), "encoder_hidden_states": (B, 77, 32)}
    ),
    # Four levels (three downsamplings), t as a ratio in [0, 1], pooled CLIP text (B, 1, 32).
    "StableCascadeUNet": Recipe(x_shape=(B, 4, 16, 16), t_scale=1.0, cond={"clip_text_pooled": (B, 1, 32)}),
    # Projections and heads on (batch, [tokens,] width) inputs.
    "CLIPImageProjection": Recipe(x_shape=(B, 32), t=None),
    "ReduxImageEncoder": Recipe({"txt_in_features": 32}, x_shape=(B, 4, 32), t=None),
    "Ideogram4PromptEnhancerHead": Recipe(x_shape=(B, 4, 32), t=None),
    "StableAudio3DurationEmbedder": Recipe(x="seconds", x_shape=(B,), t=None),
    "StableAudioProjectionModel": Recipe(
        {"text_encoder_dim": 32, "conditioning_dim": 32, "min_value": 0, "max_value": 10},
        x="text_hidden_states",
        x_shape=(B, TEXT, 32),
        t=None,
        cond={
            "start_seconds": lambda m: torch.full((B,), 1.0),
            "end_seconds": lambda m: torch.full((B,), 5.0),
        },
    ),
    # Audio DiT: 64 latent channels, cross-attention and global conditioning of width 32.
    "StableAudioDiTModel": Recipe(
        x_shape=(B, 64, 16),
        cond={"encoder_hidden_states": (B, TEXT, WIDTH), "global_hidden_states": (B, 1, WIDTH)},
    ),
    # Continuous-input transformers need their latent channels.
    "Transformer2DModel": Recipe({"in_channels": 4}),
    "DreamLiteTransformer2DModel": Recipe({"in_channels": 4}),
    # Its blocks' skip widths assume 3 layers per block.
    "Kandinsky3UNet": Recipe(
        dict(layers_per_block=3),
        x_shape=(B, 4, 16, 16),
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "encoder_attention_mask": lambda m: torch.ones(B, TEXT),
        },
    ),
    # Autoencoders whose downsampling needs larger samples than the generic ones: a waveform of
    # one hop (the encoder rates' product, 960) x 2; video at 32 x 32 (16x spatial compression);
    # QwenImage 2.1's 4-channel single frame.
    "AutoencoderKLKVAEAudio": Recipe(x_shape=(B, 1, 1920), t=None),
    "AutoencoderKLHunyuanVideo15": Recipe(x_shape=(B, 3, 5, 32, 32), t=None),
    "AutoencoderKLHunyuanImageRefiner": Recipe(x_shape=(B, 3, 5, 32, 32), t=None),
    "AutoencoderKLQwenImage21": Recipe(x_shape=(B, 4, 1, 32, 32), t=None),
    # Video UNet conditioned on fps, the first frame's latents and an image embedding.
    "I2VGenXLUNet": Recipe(
        x_shape=(B, 4, FRAMES, SIDE, SIDE),
        cond={
            "fps": lambda m: torch.full((B,), 8, dtype=torch.long),
            "image_latents": (B, 4, FRAMES, SIDE, SIDE),
            "image_embeddings": (B, WIDTH),
            "encoder_hidden_states": (B, TEXT, WIDTH),
        },
    ),
    # Controlnets of the transformers above: their inputs plus a latent-space control input.
    "FluxControlNetModel": Recipe(
        dict(in_channels=16, joint_attention_dim=WIDTH, pooled_projection_dim=WIDTH),
        x_shape=(B, 16, 16),
        t_scale=1.0,
        cond={
            "controlnet_cond": (B, 16, 16),
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_projections": (B, WIDTH),
            "img_ids": lambda m: _ids(16),
            "txt_ids": lambda m: _ids(TEXT),
        },
    ),
    "SD3ControlNetModel": Recipe(
        dict(caption_projection_dim=HEADS * HEAD_DIM),
        cond={
            "controlnet_cond": (B, 16, SIDE, SIDE),
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_projections": (B, WIDTH),
        },
    ),
    "FluxMultiControlNetModel": Recipe(
        # One net runs as ControlNet-Union: it needs modes (num_mode).
        model=lambda sub: __import__("diffusers").FluxMultiControlNetModel(
            [_with(sub("FluxControlNetModel"), num_mode=2)]
        ),
        x_shape=(B, 16, 16),
        t_scale=1.0,
        cond={
            "controlnet_cond": lambda m: [torch.randn(B, 16, 16)],
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_projections": (B, WIDTH),
            "img_ids": lambda m: _ids(16),
            "txt_ids": lambda m: _ids(TEXT),
            "controlnet_mode": lambda m: [torch.zeros(B, dtype=torch.long)],
        },
        fixed={"conditioning_scale": [1.0]},
    ),
    "SD3MultiControlNetModel": Recipe(
        model=lambda sub: __import__("diffusers").SD3MultiControlNetModel([sub("SD3ControlNetModel")]),
        x_shape=(B, 16, SIDE, SIDE),
        cond={
            "controlnet_cond": lambda m: [torch.randn(B, 16, SIDE, SIDE)],
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_projections": (B, WIDTH),
        },
        fixed={"conditioning_scale": [1.0]},
    ),
    "HunyuanDiT2DControlNetModel": _HUNYUAN_DIT_CONTROL,
    "HunyuanDiT2DMultiControlNetModel": replace(
        _HUNYUAN_DIT_CONTROL,
        model=lambda sub: __import__("diffusers").HunyuanDiT2DMultiControlNetModel(
            [sub("HunyuanDiT2DControlNetModel")]
        ),
        cond=_HUNYUAN_DIT.cond | {"controlnet_cond": lambda m: [torch.randn(B, 4, SIDE, SIDE)]},
        fixed=_HUNYUAN_DIT.fixed | {"conditioning_scale": [1.0]},
    ),
    # Masked-token transformer: an 8 x 8 grid of codebook ids, pooled text and one micro-condition
    # (its embedding is sized for one at these widths).
    "UVit2DModel": Recipe(
        x="input_ids",
        x_make=lambda: torch.randint(0, 32, (B, SIDE, SIDE)),
        t=None,
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "pooled_text_emb": (B, WIDTH),
            "micro_conds": (B, 1),
        },
    ),
    # AnimateDiff's sparse controlnet: text states per frame, a control image at 2x the latents
    # with its mask.
    "SparseControlNetModel": Recipe(
        x_shape=(B, 4, FRAMES, SIDE, SIDE),
        cond={
            "encoder_hidden_states": (B * FRAMES, TEXT, 8),
            "controlnet_cond": (B, 3, FRAMES, 2 * SIDE, 2 * SIDE),
            "conditioning_mask": (B, 1, FRAMES, 2 * SIDE, 2 * SIDE),
        },
    ),
    # Audio decoders: (batch, channels, frames) latents or mel spectrograms; the vocoder's first
    # width must halve six times.
    "MiniMaxMusic3RVQDepthDecoder": Recipe(x="inputs_embeds", x_shape=(B, 8, 32), t=None),
    "MiniMaxMusic3Vocoder": Recipe(x_shape=(B, 32, 8), t=None),
    "MMAudioVocoder": Recipe(
        {"upsample_initial_channel": 64, "num_mels": 16}, x="mel", x_shape=(B, 16, 8), t=None
    ),
    # Waveform autoencoder: the encoder's latent (encoder_latent_dim) is mean and scale of the
    # decoder's (latent_dim); two hops of its 2048x downsampling.
    "LongCatAudioDiTVae": Recipe({"latent_dim": 16, "encoder_latent_dim": 32}, x_shape=(B, 1, 4096), t=None),
    "MMAudioVAE": Recipe(x_shape=(B, 8192), t=None),  # a waveform; encodes its mel spectrogram
    # UniDiffuser's caption decoder: a one-layer GPT-2 after 4 prefix embeddings.
    "UniDiffuserTextDecoder": Recipe(
        dict(
            prefix_length=4,
            prefix_inner_dim=32,
            vocab_size=64,
            n_positions=32,
            n_embd=32,
            n_layer=1,
            n_head=2,
        ),
        x="input_ids",
        x_make=lambda: torch.randint(0, 64, (B, 6)),
        t=None,
        cond={"prefix_embeds": (B, 4, 32)},
    ),
    # Video autoencoder: 16x spatial and 4x temporal compression (5 frames of 32 x 32).
    "Kandinsky6SRVAE": Recipe(
        dict(
            encoder_block_out_channels=(8, 16, 16, 16, 16),
            decoder_block_out_channels=(8, 16, 16, 16, 16),
            latent_channels=8,
            layers_per_block=1,
        ),
        x_shape=(B, 3, 5, 32, 32),
        t=None,
    ),
    # UniDiffuser's joint transformer: patched 4-channel image latents stepped with their own
    # timestep, a CLIP image embedding, TEXT prompt tokens with a text timestep.
    "UniDiffuserModel": Recipe(
        dict(in_channels=4, out_channels=4, sample_size=SIDE, patch_size=2, num_text_tokens=TEXT),
        x="latent_image_embeds",
        x_shape=(B, 4, SIDE, SIDE),
        t="timestep_img",
        cond={
            "image_embeds": (B, 1, 32),
            "prompt_embeds": (B, TEXT, 32),
            "timestep_text": lambda m: torch.full((B,), 500.0),
        },
    ),
    # Spectrogram diffusion decoder: 16 frames of 8 mel bins, noise time in [0, 1), one encoder
    # stream (states and mask) passed as is.
    "T5FilmDecoder": Recipe(
        dict(input_dims=8, targets_length=16, d_model=32, num_heads=2, d_kv=16, d_ff=64),
        x="decoder_input_tokens",
        x_shape=(B, 16, 8),
        t="decoder_noise_time",
        t_scale=1.0,
        fixed={"encodings_and_masks": [(torch.randn(B, TEXT, 32), torch.ones(B, TEXT, dtype=torch.bool))]},
    ),
    # QwenImage 2.1: TEXT vision-language positions then one image slot per 2 x 2 latent tokens
    # (img_mask), a 4 x 4 target image, t in [0, 1].
    "QwenImage21Transformer2DModel": Recipe(
        x_shape=(B, 16, 64),
        t_scale=1.0,
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "img_mask": lambda m: torch.arange(TEXT + 4).ge(TEXT).unsqueeze(0),
        },
        fixed={"img_shapes": [[(1, 4, 4)]]},
    ),
    # Wrappers of one model each, called with one-element lists of conditions and scales.
    "MultiControlNetModel": Recipe(
        model=lambda sub: __import__("diffusers").MultiControlNetModel([sub("ControlNetModel")]),
        x_shape=(B, 4, SIDE, SIDE),
        cond={
            "encoder_hidden_states": (B, TEXT, WIDTH),
            "controlnet_cond": lambda m: [torch.randn(B, 3, 2 * SIDE, 2 * SIDE)],
        },
        fixed={"conditioning_scale": [1.0]},
    ),
    "QwenImageMultiControlNetModel": Recipe(
        model=lambda sub: __import__("diffusers").QwenImageMultiControlNetModel(
            [sub("QwenImageControlNetModel")]
        ),
        x_shape=(B, 16, 16),
        cond={
            "controlnet_cond": lambda m: [torch.randn(B, 16, 16)],
            "encoder_hidden_states": (B, TEXT, 16),
            "encoder_hidden_states_mask": lambda m: torch.ones(B, TEXT),
        },
        fixed={"img_shapes": [[(1, 4, 4)]], "conditioning_scale": [1.0]},
        t_scale=1.0,
    ),
    "MultiAdapter": Recipe(
        model=lambda sub: __import__("diffusers").MultiAdapter([sub("T2IAdapter"), sub("T2IAdapter")]),
        x="xs",
        x_shape=(2, B, 3, 64, 64),  # one image per adapter (forward zips over dim 0)
        t=None,
    ),
}


def _with(model, **config):
    """`model`'s class rebuilt with its config changed."""
    torch.manual_seed(0)
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    return type(model)(**(cfg | config)).eval()


def _full(n, v):
    import torch

    return torch.full((n,), float(v))


# The classes named in the issue and other widely used ones run first (the rest follow).
PRIORITY = (
    "UNet2DConditionModel",
    "UNet2DModel",
    "AutoencoderKL",
    "DiTTransformer2DModel",
    "PixArtTransformer2DModel",
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
    "SanaTransformer2DModel",
    "HunyuanDiT2DModel",
    "WanTransformer3DModel",
    "LTXVideoTransformer3DModel",
    "CogVideoXTransformer3DModel",
    "AuraFlowTransformer2DModel",
    "Lumina2Transformer2DModel",
    "LuminaNextDiT2DModel",
    "QwenImageTransformer2DModel",
    "Flux2Transformer2DModel",
    "ChromaTransformer2DModel",
    "CogView4Transformer2DModel",
    "CogView3PlusTransformer2DModel",
    "MochiTransformer3DModel",
    "HunyuanVideoTransformer3DModel",
    "AutoencoderKLWan",
    "AutoencoderKLCogVideoX",
    "AutoencoderKLLTXVideo",
    "AutoencoderKLHunyuanVideo",
    "AutoencoderKLFlux2",
    "AutoencoderTiny",
    "VQModel",
    "AsymmetricAutoencoderKL",
    "ControlNetModel",
    "UNet3DConditionModel",
    "UNet1DModel",
    "StableAudioDiTModel",
    "AllegroTransformer3DModel",
    "LatteTransformer3DModel",
    "PriorTransformer",
    "Transformer2DModel",
)

# ---------------------------------------------------------------------------------------------
# Inputs

_X_NAMES = ("hidden_states", "sample", "x", "latents", "input_ids")
_T_NAMES = ("timestep", "timesteps", "t", "timestep_ratio")
_TEXT_WIDTHS = (
    "cross_attention_dim",
    "joint_attention_dim",
    "caption_channels",
    "text_dim",
    "text_embed_dim",
    "cap_feat_dim",
    "encoder_hidden_size",
    "text_emb_dim",
    "encoder_hid_dim",
    "context_dim",
    "cross_attention_input_dim",
)


def _is_video(name: str) -> bool:
    video = (
        "Wan",
        "Mochi",
        "QwenImage",
        "VidTok",
        "HunyuanImageRefiner",
        "Magvit",
        "Cosmos",
        "Allegro",
        "MiniMax",
    )
    return (
        "3D" in name or "Video" in name or (name.startswith("Autoencoder") and any(v in name for v in video))
    )


def _x_shape(name: str, cfg, params) -> tuple:
    c = cfg.get("in_channels") or cfg.get("input_channels") or cfg.get("audio_channels") or 3
    if "img_ids" in params:  # packed latents (Flux style): (batch, tokens, channels)
        return (B, (SIDE // 2) ** 2, c)
    if "1D" in name or "Audio" in name or "Oobleck" in name:
        return (B, c, 64)
    if _is_video(name):
        return (B, c, FRAMES, SIDE, SIDE)
    side = 16 if name.startswith(("Autoencoder", "VQ", "Asymmetric", "Consistency")) else SIDE
    return (B, c, side, side)


def _generic_input(name: str, p, cfg: dict, x):
    """A value for forward argument `name` (a shape, a callable or None for "leave it out")."""
    import torch

    required = p.default is inspect.Parameter.empty
    seq = x.shape[1] if x.dim() == 3 else None
    axes = len(cfg.get("axes_dims_rope") or cfg.get("axes_dim_rope") or (0, 0, 0))
    if name in ("img_ids",):
        return lambda m: _ids(seq or (SIDE // 2) ** 2, axes)
    if name == "txt_ids":
        return lambda m: _ids(TEXT, axes)
    if name == "guidance" and cfg.get("guidance_embeds"):
        return lambda m: _full(B, 3.5)
    if name == "pooled_projections" and isinstance(cfg.get("pooled_projection_dim"), int):
        return (B, cfg["pooled_projection_dim"])
    if not required:
        return None
    if name in (
        "encoder_attention_mask",
        "encoder_mask",
        "text_embedding_mask",
        "encoder_hidden_states_mask",
    ):
        return lambda m: torch.ones(B, TEXT, dtype=torch.long)
    if name == "class_labels":
        return lambda m: torch.ones(B, dtype=torch.long)
    if name in ("original_size", "target_size"):
        return lambda m: torch.full((B, 2), 64.0)
    if name == "crop_coords":
        return lambda m: torch.zeros(B, 2)
    if name == "controlnet_cond":
        return (B, cfg.get("conditioning_channels", 3), 8 * x.shape[-2], 8 * x.shape[-1])
    if name in ("encoder_hidden_states", "context", "cap_feats"):
        width = next((cfg[k] for k in _TEXT_WIDTHS if isinstance(cfg.get(k), int)), WIDTH)
        return (B, TEXT, width)
    return None


@dataclass
class Case:
    model: object
    x_name: str
    x: object
    t_name: str | None
    t_values: list
    cond_names: list
    cond: list
    fixed: dict
    x_in_list: bool = False  # the model takes x as a one-element list


_SPECS = ("randn", "full", "tensor", "list", "tuple")


def _is_spec(v) -> bool:
    return isinstance(v, tuple) and len(v) >= 2 and v[0] in _SPECS


def _make(spec):
    """The value of a `TESTED` input spec (module docstring of sweep_diffusers_configs)."""
    if _is_spec(spec):
        kind = spec[0]
        if kind == "randn":
            return torch.randn(spec[1])
        if kind == "full":
            return torch.full(spec[1], spec[2], dtype=getattr(torch, spec[3]))
        if kind == "tensor":
            return torch.tensor(spec[1], dtype=getattr(torch, spec[2]))
        made = [_make(s) for s in spec[1]]
        return tuple(made) if kind == "tuple" else made
    if isinstance(spec, dict):
        return {k: _make(v) for k, v in spec.items()}
    return spec


def _t_max(spec) -> float:
    if spec[0] == "full":
        return abs(float(spec[2]))
    if spec[0] == "tensor":
        return max(abs(float(v)) for v in torch.tensor(spec[1]).flatten().tolist())
    return 1.0  # randn


def build_tested(name: str) -> Case:
    """A class from `TESTED`: its tiny config and one call's inputs; x is the sample input (the
    first known name), t the timestep (stepped over the test's scale: [0, 1] where the test's
    timestep is at most 1, else 1000), tensors (and lists of them) are conditioning, the rest is
    passed as is."""
    import diffusers

    cls = getattr(diffusers, name)
    entry = TESTED[name]
    torch.manual_seed(0)
    model = cls(**entry["config"]).eval()
    inputs = dict(entry["inputs"])
    x_name = next((n for n in _X_NAMES if n in inputs), next(iter(inputs)))
    x_spec = inputs.pop(x_name)
    x_in_list = x_spec[0] == "list"
    x = _make(x_spec[1][0] if x_in_list else x_spec)
    t_name = next((n for n in _T_NAMES if n in inputs and _is_spec(inputs[n])), None)
    t_values = [None] * STEPS
    if t_name is not None:
        t_spec = inputs.pop(t_name)
        shape = t_spec[1] if t_spec[0] != "tensor" else tuple(torch.tensor(t_spec[1]).shape)
        scale = 1.0 if _t_max(t_spec) <= 1.0 else 1000.0
        t_values = [torch.full(shape, scale * (0.9 - 0.3 * i)) for i in range(STEPS)]
    names, values, fixed = [], [], {}
    for k, v in inputs.items():
        if _is_spec(v):
            names.append(k)
            values.append(_make(v))
        else:
            fixed[k] = _make(v)
    return Case(model, x_name, x, t_name, t_values, names, values, fixed, x_in_list)


def build(name: str) -> Case:
    import diffusers
    import torch

    if name in TESTED and name not in RECIPES:
        return build_tested(name)
    cls = getattr(diffusers, name)
    r = RECIPES.get(name, Recipe())
    if r.model is not None:
        torch.manual_seed(0)
        model = r.model(lambda n: build(n).model).eval()
        return _inputs(name, r, model)
    if name in CONFIGS:  # a pipeline test's tiny config, under the recipe's own settings
        config = CONFIGS[name] | r.config
    else:
        config = (shrink(cls) if r.shrink else {}) | r.config
    torch.manual_seed(0)
    model = cls(**config).eval()
    return _inputs(name, r, model)


def _inputs(name: str, r: Recipe, model) -> Case:
    cfg = dict(getattr(model, "config", {}))
    params = inspect.signature(model.forward).parameters
    x_name = r.x or next((n for n in _X_NAMES if n in params), None)
    if x_name is None:
        raise TypeError(f"no known sample input among forward's {list(params)}")
    x = r.x_make() if r.x_make else torch.randn(r.x_shape or _x_shape(name, cfg, params))
    t_name = next((n for n in _T_NAMES if n in params), None) if r.t == "auto" else r.t
    t_values = [torch.full((B,), r.t_scale * (0.9 - 0.3 * i)) for i in range(STEPS)]
    cond = dict(r.cond)
    if not r.cond and "encoder_hidden_states" in params:
        width = next((cfg[k] for k in _TEXT_WIDTHS if isinstance(cfg.get(k), int)), WIDTH)
        cond["encoder_hidden_states"] = (B, TEXT, width)
    if not r.cond and "pooled_projections" in params and isinstance(cfg.get("pooled_projection_dim"), int):
        cond["pooled_projections"] = (B, cfg["pooled_projection_dim"])
    for k, p in params.items():
        if k in cond or k in r.fixed or k in (x_name, t_name) or k in ("return_dict",):
            continue
        if r.cond and p.default is not inspect.Parameter.empty:
            continue
        made = _generic_input(k, p, cfg, x)
        if made is not None:
            cond[k] = made
    names, values = [], []
    for k, v in cond.items():
        names.append(k)
        values.append(v(model) if callable(v) else torch.randn(v))
    return Case(model, x_name, x, t_name, t_values, names, values, dict(r.fixed))


class Step(torch.nn.Module):
    """`forward(x, t, *cond)` -> the model's first output as one tensor."""

    def __init__(self, case: Case):
        super().__init__()
        self.model = case.model
        self.case_names = (case.x_name, case.t_name, tuple(case.cond_names))
        self.fixed = case.fixed
        self.x_in_list = case.x_in_list
        self.return_dict = "return_dict" in inspect.signature(case.model.forward).parameters

    def forward(self, x, t, *cond):
        x_name, t_name, cond_names = self.case_names
        kw = {x_name: [x] if self.x_in_list else x, **dict(zip(cond_names, cond, strict=True)), **self.fixed}
        if t_name is not None:
            kw[t_name] = t
        if self.return_dict:
            kw["return_dict"] = False
        out = self.model(**kw)
        while not hasattr(out, "shape"):
            if isinstance(out, tuple | list):
                out = out[0]
            elif hasattr(out, "sample"):
                out = out.sample
            else:
                out = out[0]
        return out


def denoise(fn, case: Case, inputs: list | None = None) -> tuple[list, list]:
    """STEPS Euler steps `x <- x - out / STEPS` (the output's leading channels when it has more,
    e.g. a learned variance); returns every step's input and output. With `inputs` (eager's),
    step i is called on inputs[i] rather than on the x its own outputs made: a compiled model is
    compared call by call on the same inputs, because deep denoisers amplify float32 rounding
    along the trajectory (Kandinsky3UNet: eager at 1 vs 2 threads ends 3.5e-4 apart after 3
    steps, while each call of tpuc is as close to a float64 run as eager's is)."""
    import torch

    x = case.x.clone()
    ins, outs = [], []
    with torch.no_grad():
        for i, t in enumerate(case.t_values):
            if inputs is not None:
                x = inputs[i]
            ins.append(x)
            out = fn(x, t, *case.cond)
            outs.append(out.detach().clone())
            if out.shape != x.shape and out.dim() == x.dim() and out.shape[2:] == x.shape[2:]:
                out = out[:, : x.shape[1]]
            if out.shape == x.shape and x.is_floating_point():
                x = x - out / STEPS
    return ins, outs


def compare(actual: list, expected: list) -> tuple[bool, float, float]:

    scale = max(float(e.abs().max()) for e in expected) if expected else 0.0
    atol = ATOL_REL * max(scale, 1e-30)
    ok, err = True, 0.0
    for a, e in zip(actual, expected, strict=True):
        if a.shape != e.shape:
            return False, math.inf, scale
        d = (a.double() - e.double()).abs()
        err = max(err, float(d.max()))
        ok &= bool((d <= atol + RTOL * e.double().abs()).all())
    return ok, err, scale


def _fill_zero_parameters(model) -> None:
    """Every all-zero parameter of `model` drawn from N(0, 0.02^2) (seeded)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and not bool(p.any()):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)


def work(name: str) -> dict:
    import logging

    import torch

    logging.getLogger("diffusers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    res = {"name": name, "built": False, "aot_eager_ok": None, "tpu_ok": None}
    t0 = time.time()
    try:
        case = build(name)
        step = Step(case)
        inputs, expected = denoise(step, case)
        if all(float(e.abs().max()) == 0 for e in expected):
            # Zero-initialized output layers (controlnets' zero convolutions, adaLN-zero heads)
            # make every output 0 and the comparison vacuous: give them small random weights.
            _fill_zero_parameters(case.model)
            inputs, expected = denoise(step, case)
    except Exception as e:  # noqa: BLE001
        res["error"] = "build: " + sweep_runner.short_error(e)
        return res
    res["built"] = True
    res["params"] = sum(p.numel() for p in case.model.parameters())
    res["out_shape"] = list(expected[0].shape)
    res["eager_s"] = round(time.time() - t0, 2)
    if os.environ.get("SWEEP_BUILD_ONLY"):
        return res

    t0 = time.time()
    torch._dynamo.reset()
    try:
        ok, err, _ = compare(
            denoise(torch.compile(step, backend="aot_eager", dynamic=False), case, inputs)[1], expected
        )
        res["aot_eager_ok"] = ok
        if not ok:
            res["aot_eager_error"] = f"mismatch: max abs err {err:.3g}"
    except Exception as e:  # noqa: BLE001
        res["aot_eager_ok"] = False
        res["aot_eager_error"] = sweep_runner.short_error(e)
    res["aot_eager_s"] = round(time.time() - t0, 2)

    import tpuc

    t0 = time.time()
    torch._dynamo.reset()
    tpuc.reset_stats()
    try:
        compiled = torch.compile(step, backend="tpu", dynamic=False, options={"fallback": "eager"})
        ok, err, scale = compare(denoise(compiled, case, inputs)[1], expected)
        res["tpu_ok"] = ok
        res["max_abs_err"] = err
        res["max_ref"] = scale
        if not ok:
            res["error"] = f"mismatch: max abs err {err:.3g} (outputs up to {scale:.3g})"
    except Exception as e:  # noqa: BLE001
        res["tpu_ok"] = False
        res["error"] = sweep_runner.short_error(e)
    s = tpuc.stats()
    res["graphs"] = s["graphs_compiled"]
    res["fallback_ops"] = dict(s.get("fallback_ops", {}))
    res["xla_compiles"] = s["xla_compiles"]
    res["tpu_s"] = round(time.time() - t0, 2)
    return res


def markdown(results: list[dict]) -> str:
    n = len(results)
    built = sum(bool(r.get("built")) for r in results)
    aot = sum(r.get("aot_eager_ok") is True for r in results)
    tpu = sum(r.get("tpu_ok") is True for r in results)
    both = [r for r in results if r.get("aot_eager_ok")]
    tpu_of_aot = sum(bool(r.get("tpu_ok")) for r in both)
    lines = [
        "# diffusers sweep (bench/sweep_diffusers.py)",
        "",
        f"{n} model classes; built {built}; aot_eager ok {aot}; tpu ok {tpu} "
        f"({tpu_of_aot} of the {len(both)} aot_eager compiles). {STEPS} Euler steps per class, "
        f"rtol {RTOL:g}, atol {ATOL_REL:g} x max |eager output|.",
        "",
    ]
    rows = []
    for r in results:
        e, m = r.get("max_abs_err"), r.get("max_ref")
        rows.append(
            [
                r["name"],
                sweep_runner.cell(r.get("built")),
                sweep_runner.cell(r.get("aot_eager_ok")),
                sweep_runner.cell(r.get("tpu_ok")),
                "" if e is None else f"{e:.2g}",
                "" if m is None else f"{m:.3g}",
                r.get("graphs", ""),
                r.get("wall_s", ""),
                ", ".join(f"{k} x{v}" for k, v in (r.get("fallback_ops") or {}).items()),
                sweep_runner.error_cell(r),
            ]
        )
    header = [
        "class",
        "built",
        "aot_eager",
        "tpu",
        "max abs err",
        "max \\|out\\|",
        "graphs",
        "wall s",
        "ops in PyTorch",
        "error",
    ]
    lines += sweep_runner.table(header, rows, right=(4, 5, 6, 7))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sweep_runner.main(
        script=__file__,
        title="diffusers sweep",
        stem="sweep_diffusers",
        names=model_classes(),
        work=work,
        markdown=markdown,
        default_timeout=240,
        priority=PRIORITY,
    )
