"""Compiling for a TPU slice this machine does not have (options={"target": "tpu:v5e:2x2"}):
libtpu's compile-only topology, real XLA:TPU executables in the cache, memory per chip and
cost before deployment, meshes, training steps, buckets and models on the meta device."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import zoo
from torch import nn

import tpuc
from tpuc import cli, runtime, targets

pytestmark = pytest.mark.skipif(
    runtime._installed_plugin("tpu") is None,
    reason="libtpu is not installed (scripts/setup.sh installs it; offline machines skip these)",
)

V5E = "tpu:v5e:2x2"


def _precompile(model, inputs, tmp_path, **kw):
    options = {"target": kw.pop("target", V5E), "cache_dir": str(tmp_path / "cache"), **kw.pop("options", {})}
    torch._dynamo.reset()
    return tpuc.precompile(model, inputs, options=options, **kw)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    "text",
    ["tpu", "tpu:v9:2x2", "tpu:v5e:two", "gpu:h100:1", "tpu:v5e:2x2:1", 3],
)
def test_a_bad_target_names_what_is_accepted(text):
    with pytest.raises(ValueError, match="v4, v5e, v5p, v6e"):
        torch.compile(nn.Linear(2, 2), backend="tpu", options={"target": text})(torch.ones(2))


def _whisper_encoder():
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(
        vocab_size=256,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    return zoo.FirstOutput(WhisperEncoder(cfg).eval(), "input_features"), [torch.randn(2, 16, 64)]


# ResNet-18 is compiled by the training test below; the three strategies on 2x2 and the other
# models' training runs are in bench/bench_targets.py.
@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "vit", "whisper_encoder"])
def test_reference_models_compile_for_a_tpu_with_memory_per_chip(name, tmp_path):
    model, inputs = _whisper_encoder() if name == "whisper_encoder" else zoo.make(name)
    dump = tmp_path / "dump"
    report = _precompile(model, inputs, tmp_path, options={"dump_dir": str(dump)})
    assert report["target"] == V5E
    assert report["executables"] == len(report["per_graph"]) == 1
    g = report["per_graph"][0]
    assert g["cache"] == "miss" and g["devices"] == 1
    hbm = g["hbm_bytes"]
    # Every parameter is an argument of the executable; XLA:TPU lays some out padded.
    assert _param_bytes(model) <= hbm["arguments"] <= 2 * _param_bytes(model) + 2**20, hbm
    out = model(*inputs)
    assert hbm["outputs"] >= out.numel() * out.element_size(), hbm
    assert hbm["code"] > 0 and g["flops"] > 0 and g["compile_seconds"] > 0
    assert g["footprint_bytes"] <= 16 << 30
    # What a TPU gets: no CPU host kernel calls in the module.
    mlir = "\n".join(p.read_text() for p in dump.glob("*/stablehlo.mlir"))
    assert "stablehlo" in mlir and "tpuc_" not in mlir
    assert tpuc.stats()["xla_compiles"] >= 1


def _small_cnn():
    """Convolutions, batch norm and pooling with both gradients: what a training step of a CNN
    sends XLA:TPU, at a size that compiles in seconds (ResNet-18 itself is bench_tpu_twins')."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    return model, (torch.randn(2, 3, 32, 32),)


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_a_training_step_compiles_forward_and_backward(name, tmp_path):
    model, inputs = _small_cnn() if name == "cnn" else zoo.make(name)
    model.train()
    if name == "gpt2":
        model, inputs = zoo.LMLoss(model), [inputs[0], inputs[0]]
    report = _precompile(model, inputs, tmp_path, training=True)
    names = [g["name"].split("_")[-1] for g in report["per_graph"]]
    assert names == ["forward", "backward"], names
    fwd, bwd = report["per_graph"]
    # The backward's outputs are the gradients: one per parameter.
    assert bwd["hbm_bytes"]["outputs"] >= _param_bytes(model), bwd["hbm_bytes"]
    assert fwd["flops"] > 0 and bwd["flops"] > fwd["flops"] * 0.5


@pytest.mark.parametrize(
    ("sharding", "mesh", "target"),
    [
        ("tensor_parallel", [2, 2], V5E),
        ("fsdp", [16, 1], "tpu:v5e:4x4"),
    ],
)
def test_sharding_strategies_compile_for_pod_slices(sharding, mesh, target, tmp_path):
    torch.manual_seed(0)
    model = zoo.LMLoss(zoo.make("gpt2")[0])
    ids = torch.randint(0, zoo.VOCAB, (16, 12))
    options = {"mesh": {"shape": mesh, "axes": ["data", "model"]}, "sharding": sharding}
    report = _precompile(model, [ids, ids], tmp_path, target=target, options=options, training=True)
    assert [g["devices"] for g in report["per_graph"]] == [mesh[0] * mesh[1]] * 2
    if sharding == "fsdp":
        # Split over the mesh, each chip holds a part of the whole program's arguments.
        whole = _precompile(model, [ids, ids], tmp_path, target=target, training=True)
        per_chip = report["per_graph"][0]["hbm_bytes"]["arguments"]
        assert per_chip < whole["per_graph"][0]["hbm_bytes"]["arguments"] / 2


def test_buckets_compile_one_executable_per_bucket(tmp_path):
    model, (ids,) = zoo.make("gpt2")
    report = _precompile(model, [ids], tmp_path, dynamic={0: {1: 32}}, buckets=[16, 32])
    shapes = sorted(tuple(g["inputs"][-1][0]) for g in report["per_graph"] if g["inputs"])
    # The two buckets: the example's own length (12) pads to 16, as every length up to 32 does
    # on a TPU host.
    assert report["executables"] == 2, shapes
    assert sorted(g["bindings"].get(next(iter(g["bindings"]))) for g in report["per_graph"]) == [16, 32]
    # The report lists each graph's buckets, as on the CPU road.
    (per_graph_buckets,) = report["buckets"].values()
    assert sorted(v for b in per_graph_buckets for v in b.values()) == [16, 32]


def test_a_model_on_the_meta_device_reports_memory_per_chip_under_fsdp(tmp_path):
    import transformers

    # ~0.3B parameters of a Llama-style decoder (the embedding and head are most), never allocated.
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        lm = transformers.LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in lm.parameters())
    model = zoo.FirstOutput(lm, "input_ids")
    ids = torch.zeros(4, 128, dtype=torch.long, device="meta")
    mesh = {"shape": [4], "axes": ["fsdp"]}
    report = _precompile(
        model, [ids], tmp_path, target="tpu:v5p:2x2x1", options={"mesh": mesh, "sharding": "fsdp"}
    )
    (g,) = report["per_graph"]
    assert g["devices"] == 4
    # fsdp: each chip holds about a quarter of the f32 weights.
    assert params * 4 / 4 <= g["hbm_bytes"]["arguments"] <= params * 4 / 4 * 1.2, (params, g["hbm_bytes"])


def test_a_graph_too_big_for_a_chip_names_both_sizes_and_a_mesh_that_fits(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(65536, 81920, bias=False), nn.ReLU())  # 20 GiB of weights
        x = torch.zeros(8, 65536)
    with pytest.raises(targets.DeviceMemoryError) as e:
        _precompile(model, [x], tmp_path, target="tpu:v5e:1x1")
    message = str(e.value)
    assert "per chip on tpu:v5e:1x1" in message and "16.00 GiB of HBM" in message, message
    assert "'sharding': 'fsdp'" in message, message


def test_calling_a_function_compiled_for_a_target_raises_after_writing_it(tmp_path, capsys):
    model, inputs = zoo.make("bert")
    cache = tmp_path / "cache"
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tpu", options={"target": V5E, "cache_dir": str(cache)})
    with pytest.raises(targets.TargetUnavailableError, match="compiled for tpu:v5e:2x2.*no TPU"):
        compiled(*inputs)
    assert isinstance(targets.TargetUnavailableError("x"), tpuc.TpucError)
    assert cli.main(["cache", "ls", "--cache-dir", str(cache)]) == 0
    listing = capsys.readouterr().out
    assert "tpu:v5e:2x2" in listing and "1 entries" in listing, listing


def test_a_new_process_finds_what_precompile_wrote_under_the_same_keys(tmp_path):
    model, inputs = zoo.make("gpt2")
    first = _precompile(model, inputs, tmp_path)
    child = textwrap.dedent(
        f"""
        import sys, torch, tpuc
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import zoo
        model, inputs = zoo.make("gpt2")
        r = tpuc.precompile(model, inputs, options={{"target": "{V5E}", "cache_dir": {str(tmp_path / "cache")!r}}})
        print("RESULT", r["compiled"], r["from_cache"], [g["key"] for g in r["per_graph"]])
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, out.stdout + out.stderr[-3000:]
    assert line == f"RESULT 0 1 {[g['key'] for g in first['per_graph']]}"


def test_on_a_device_the_target_path_runs_its_graphs_and_matches_eager():
    # What a host with the target's devices runs: the same graphs, lowered by the target's rules.
    # Here the CPU plugin stands in for the TPU (options["stand_in"]): the outputs and gradients
    # must be eager's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 17))
    x = torch.randn(33, 64)
    on_cpu = dict(backend="tpu", options={"target": V5E, "stand_in": "cpu", "cache_dir": None})

    torch._dynamo.reset()
    compiled = torch.compile(model, **on_cpu)
    got = compiled(x)
    want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want.square().sum().backward()
    for g, w in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_a_training_step_whose_gradients_stop_on_the_meta_device_warns(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        x = torch.zeros(8, 32)
        y = torch.zeros(8, dtype=torch.long)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.model(x), y)

    with pytest.warns(RuntimeWarning, match="got no gradient.*meta device"):
        _precompile(Loss(), [x, y], tmp_path, training=True)


def test_a_whole_training_step_is_one_executable_for_a_target(tmp_path):
    """zero_grad, forward, loss.backward() and AdamW's step in one compiled function
    (docs/training.md) compile to one XLA:TPU executable; calling it here then says the machine
    has no TPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    torch._dynamo.reset()
    tpuc.reset_stats()
    compiled = torch.compile(
        step, backend="tpu", options={"target": V5E, "cache_dir": str(tmp_path / "cache")}
    )
    with pytest.raises(targets.TargetUnavailableError):
        compiled(torch.randn(16, 32), torch.randn(16, 8))
    assert tpuc.stats()["graphs_compiled"] == 1
    assert tpuc.stats()["xla_compiles"] == 1


def test_precompile_of_a_whole_training_step_reports_one_executable_with_its_memory(tmp_path, capsys):
    """`tpuc.precompile(step, inputs, training="step")` for a target: the step (zero_grad,
    forward, backward, AdamW's update) is one executable; its memory per chip counts the
    parameters and AdamW's two moments among the arguments, the new ones among the outputs, and
    buffers that outputs reuse (donated) once in the footprint."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    report = _precompile(step, [torch.randn(64, 256), torch.randn(64, 256)], tmp_path, training="step")
    assert report["executables"] == 1 and report["graphs"] == 1, report
    (g,) = report["per_graph"]
    h, params = g["hbm_bytes"], _param_bytes(model)
    assert h["arguments"] >= 3 * params, h  # parameters, exp_avg, exp_avg_sq
    assert h["outputs"] >= 3 * params, h  # their new values (and the gradients)
    assert 0 <= h["aliased"] <= min(h["arguments"], h["outputs"]), h
    assert g["footprint_bytes"] == h["arguments"] + h["outputs"] - h["aliased"] + h["temporaries"] + h["code"]
    with pytest.raises(NotImplementedError, match="for a target"):
        tpuc.precompile(step, [torch.randn(64, 256), torch.randn(64, 256)], training="step")
    with pytest.raises(ValueError, match="training must be"):
        _precompile(step, [torch.randn(64, 256), torch.randn(64, 256)], tmp_path, training="steps")
    # The CLI's --step: the same step from a factory, found in the cache, in the table.
    torch._dynamo.reset()
    capsys.readouterr()
    argv = ["precompile", "cache_helpers.factories:mlp_step", "--cache-dir", str(tmp_path / "cache")]
    assert cli.main([*argv, "--target", V5E, "--step"]) == 0
    out = capsys.readouterr().out
    assert "1 executables" in out and "aliased" in out, out


def test_an_fsdp_step_splits_the_optimizer_state_and_writes_it_in_place(tmp_path):
    """fsdp over the 4 chips of a v5e:2x2: AdamW's moments are split like their parameters
    (Dynamo hands them in as buffers), and every written tensor's new value is laid out as its
    input, so all of them reuse their buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).train()
    opt = torch.optim.AdamW(model.parameters())

    def step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    x, y = torch.randn(64, 256), torch.randn(64, 256)
    step(x, y)  # the optimizer's state exists: an input of the compiled step
    mesh = {"mesh": {"shape": [4], "axes": ["data"]}, "sharding": "fsdp"}
    report = _precompile(step, [x, y], tmp_path, training="step", options=mesh)
    (g,) = report["per_graph"]
    h, state = g["hbm_bytes"], 3 * _param_bytes(model)  # parameters, exp_avg, exp_avg_sq
    assert h["arguments"] < state / 4 + 64 * 256 * 4, h  # a quarter of the state, the batch's share
    assert h["aliased"] >= 0.99 * state / 4, h


def test_a_checkpointed_step_needs_less_memory_per_chip(tmp_path):
    """Activation checkpointing in a whole step for a target: the recomputation stays in the
    backward (behind its optimization barrier, test_checkpointing.py), so XLA:TPU's plan for
    the step peaks lower than without checkpointing, for more FLOPs."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    def plan(checkpointed):
        torch.manual_seed(0)
        blocks = nn.ModuleList(Block() for _ in range(3)).train()
        opt = torch.optim.AdamW(blocks.parameters())

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            for b in blocks:
                x = checkpoint(b, x, use_reentrant=False) if checkpointed else b(x)
            loss = nn.functional.mse_loss(x, y)
            loss.backward()
            opt.step()
            return loss.detach()

        inputs = [torch.randn(1024, 64), torch.randn(1024, 64)]
        (g,) = _precompile(step, inputs, tmp_path / str(checkpointed), training="step")["per_graph"]
        return g

    plain, checkpointed = plan(False), plan(True)
    assert checkpointed["hbm_bytes"]["peak"] < plain["hbm_bytes"]["peak"], (plain, checkpointed)
    assert checkpointed["flops"] > plain["flops"]
