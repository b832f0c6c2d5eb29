"""The model zoo: small Hugging Face Transformers and torchvision models built from configs with
random weights (no downloads), for tests and benchmarks.

Every factory returns `(model.eval(), example_inputs)`; calling `model(*example_inputs)` returns
one tensor (the logits or last hidden state), so results compare directly with eager. Models are
small (2 layers, hidden 64-128, vocab 256-512, sequences of 8-16, images of 32-64 pixels) so the
whole zoo compiles and runs in minutes on two cores. Dropout probabilities are 0.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
SEQ = 12
BATCH = 2

# transformers logs config remarks (special token ids, defaults) at warning level.
logging.getLogger("transformers").setLevel(logging.ERROR)


class FirstOutput(nn.Module):
    """Calls a Hugging Face model with keyword inputs and returns its first output (the logits or
    the last hidden state) as a plain tensor."""

    def __init__(self, model: nn.Module, *input_names: str, **fixed):
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.fixed = fixed

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.input_names, inputs, strict=True)), **self.fixed, return_dict=False)
        return out[0]


class LMLoss(nn.Module):
    """A decoder LM (a zoo factory's model) and its next-token cross-entropy in one module, so
    the loss and its gradient compile too: `forward(target, ids)` -> scalar loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, target, ids):
        logits = self.lm(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _ids(batch=BATCH, seq=SEQ, vocab=VOCAB):
    return torch.randint(0, vocab, (batch, seq))


def _mask(batch=BATCH, seq=SEQ):
    """An attention mask with padding at the end of the last sequence."""
    m = torch.ones(batch, seq, dtype=torch.long)
    m[-1, seq - 3 :] = 0
    return m


def _decoder(model):
    return FirstOutput(model, "input_ids", use_cache=False), (_ids(),)


def _encoder(model, token_types=False):
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else [])
    inputs = [_ids(), _mask()]
    if token_types:
        tt = torch.zeros(BATCH, SEQ, dtype=torch.long)
        tt[:, SEQ // 2 :] = 1
        inputs.append(tt)
    return FirstOutput(model, *names), tuple(inputs)


def _hf(cls_name: str, model_name: str, attn="sdpa", **config):
    import transformers

    cfg = getattr(transformers, cls_name)(**config)
    cfg._attn_implementation = attn
    return getattr(transformers, model_name)(cfg)


# Sizes shared by the decoder LMs: hidden 64, 4 heads, 2 layers.
_DEC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def gpt2():
    m = _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _decoder(m)


def llama():
    return _decoder(
        _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, max_position_embeddings=64, **_DEC)
    )


def mistral():
    return _decoder(
        _hf(
            "MistralConfig",
            "MistralForCausalLM",
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=8,
            **_DEC,
        )
    )


def qwen2():
    return _decoder(
        _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, max_position_embeddings=64, **_DEC)
    )


def qwen3():
    return _decoder(
        _hf(
            "Qwen3Config",
            "Qwen3ForCausalLM",
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            **_DEC,
        )
    )


def phi():
    return _decoder(
        _hf(
            "PhiConfig",
            "PhiForCausalLM",
            max_position_embeddings=64,
            partial_rotary_factor=0.5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            **_DEC,
        )
    )


def gpt_neox():
    return _decoder(
        _hf(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            max_position_embeddings=64,
            rotary_pct=0.25,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **_DEC,
        )
    )


def gemma():
    return _decoder(
        _hf(
            "GemmaConfig",
            "GemmaForCausalLM",
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
            **_DEC,
        )
    )


def opt():
    return _decoder(
        _hf(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


# Sizes shared by the BERT-like encoders.
_ENC = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def bert():
    return _encoder(_hf("BertConfig", "BertModel", **_ENC), token_types=True)


def roberta():
    return _encoder(_hf("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1, **_ENC))


def electra():
    return _encoder(
        _hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=32, num_labels=3, **_ENC)
    )


def albert():
    return _encoder(_hf("AlbertConfig", "AlbertModel", embedding_size=32, **_ENC), token_types=True)


def distilbert():
    m = _hf(
        "DistilBertConfig",
        "DistilBertModel",
        vocab_size=VOCAB,
        dim=64,
        hidden_dim=128,
        n_layers=2,
        n_heads=4,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return _encoder(m)


def t5():
    m = _hf(
        "T5Config",
        "T5ForConditionalGeneration",
        attn="eager",
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    dec = _ids(seq=SEQ // 2)
    return FirstOutput(m, "input_ids", "attention_mask", "decoder_input_ids", use_cache=False), (
        _ids(),
        _mask(),
        dec,
    )


def bart():
    m = _hf(
        "BartConfig",
        "BartForConditionalGeneration",
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    dec = _ids(seq=SEQ // 2)
    return FirstOutput(m, "input_ids", "attention_mask", "decoder_input_ids", use_cache=False), (
        _ids(),
        _mask(),
        dec,
    )


def _pixels(size=32, batch=BATCH):
    return torch.randn(batch, 3, size, size)


def vit():
    m = _hf(
        "ViTConfig",
        "ViTForImageClassification",
        image_size=32,
        patch_size=8,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return FirstOutput(m, "pixel_values"), (_pixels(),)


def swin():
    m = _hf(
        "SwinConfig",
        "SwinForImageClassification",
        attn="eager",
        image_size=32,
        patch_size=2,
        embed_dim=32,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return FirstOutput(m, "pixel_values"), (_pixels(),)


def convnext():
    m = _hf(
        "ConvNextConfig",
        "ConvNextForImageClassification",
        attn="eager",
        image_size=32,
        num_channels=3,
        patch_size=2,
        hidden_sizes=[32, 64],
        depths=[1, 1],
        num_stages=2,
        num_labels=10,
        drop_path_rate=0.0,
    )
    return FirstOutput(m, "pixel_values"), (_pixels(),)


def _random_bn_stats(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics, so eval-mode BatchNorm is not an identity."""
    g = torch.Generator().manual_seed(1)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) - 0.5)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
    return model


def resnet18():
    from torchvision.models import resnet18 as make

    # The real ResNet-18 (BasicBlock, widths 64-512) on 32x32 images: about 37 MFLOPs a sample.
    return _random_bn_stats(make(num_classes=10)), (_pixels(32),)


def mobilenet_v2():
    from torchvision.models import mobilenet_v2 as make

    return _random_bn_stats(make(num_classes=10, width_mult=0.25, dropout=0.0)), (_pixels(32),)


def mobilenet_v3():
    from torchvision.models import mobilenet_v3_small as make

    return _random_bn_stats(make(num_classes=10, width_mult=0.25, dropout=0.0)), (_pixels(32),)


def efficientnet_b0():
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf

    settings, last = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
    m = EfficientNet(settings, dropout=0.0, stochastic_depth_prob=0.0, num_classes=10, last_channel=last)
    return _random_bn_stats(m), (_pixels(32),)


FACTORIES = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "phi": phi,
    "gpt_neox": gpt_neox,
    "gemma": gemma,
    "opt": opt,
    "bert": bert,
    "roberta": roberta,
    "electra": electra,
    "albert": albert,
    "distilbert": distilbert,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "swin": swin,
    "convnext": convnext,
    "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2,
    "mobilenet_v3": mobilenet_v3,
    "efficientnet_b0": efficientnet_b0,
}

NAMES = list(FACTORIES)


def make(name: str, seed: int = 0):
    """`(model in eval mode, example inputs)` for zoo model `name`, with seeded random weights."""
    torch.manual_seed(seed)
    model, inputs = FACTORIES[name]()
    return model.eval(), inputs


# CNNs train on 4 images of 64x64: with 2 images of 32x32 ResNet's last BatchNorm sees 2 values
# per channel, and its gradients are so ill-conditioned that eager float32 itself is off by 1e-2
# from float64.
TRAINING_IMAGES = {"resnet18": (4, 64)}


class WithLoss(nn.Module):
    """The model and its loss in one module, so the loss and its gradient are compiled too:
    cross-entropy for logits ([B, T, V] tokens or [B, C] classes), mean squared error for
    hidden states."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, target, *inputs):
        out = self.model(*inputs)
        if self.kind == "tokens":
            return F.cross_entropy(out.flatten(0, 1), target.flatten())
        if self.kind == "classes":
            return F.cross_entropy(out, target)
        return F.mse_loss(out, target)


def training_setup(name: str):
    """`(WithLoss(model) in train mode, (target, *inputs))` for zoo model `name`."""
    model, inputs = make(name)
    if name in TRAINING_IMAGES:
        b, s = TRAINING_IMAGES[name]
        inputs = (torch.randn(b, 3, s, s),)
    with torch.no_grad():
        out = model(*inputs)
    if out.dim() == 3 and out.shape[-1] == VOCAB:
        kind, target = "tokens", torch.randint(0, VOCAB, out.shape[:2])
    elif out.dim() == 2:
        kind, target = "classes", torch.randint(0, out.shape[1], out.shape[:1])
    else:
        kind, target = "hidden", torch.randn(out.shape)
    return WithLoss(model, kind).train(), (target, *inputs)


def assert_close_scaled(actual, expected, what, rel=1e-4):
    """|actual - expected| <= rel * max|expected| (+ a tiny floor): tolerances scaled to each
    tensor, since gradients of different parameters differ by orders of magnitude."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    assert err <= rel * scale + 1e-7, f"{what}: max abs error {err:.3g}, scale {scale:.3g}"


def assert_close_to_eager_or_float64(actual, expected, exact, what):
    """A gradient (or parameter) within `assert_close_scaled` of eager's, or, where eager's own float32 rounding
    is that far from the float64 gradient `exact`, no more than 8x as far from it as eager is: a
    different summation order is not held to eager's rounding errors, while a wrong lowering (off
    by the gradient's own size) still fails. Measured: ResNet-18's second step (batch-norm
    statistics of a batch of 4, an ill-conditioned gradient): eager float32 is 2e-4 off float64 on
    bn1's bias (scale 0.056); tpuc on the default plugin 1.1e-3, whose XNNPACK/YNNPACK matmuls sum
    in longer chains (a [64, 8192] x [8192, 64] product: 1.5e-4 off float64, eager 0.9e-4,
    the plugin with those fusions off 1.1e-4)."""
    try:
        assert_close_scaled(actual, expected, what)
    except AssertionError:
        err = (actual.double() - exact).abs().max().item()
        eager_err = (expected.double() - exact).abs().max().item()
        assert err <= 8 * eager_err, f"{what}: {err:.3g} from float64, eager float32 {eager_err:.3g}"
