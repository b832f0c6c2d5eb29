#!/usr/bin/env bash
# Sets up everything tpuc needs on a fresh Debian 12 machine, skipping what is already there:
# the LLVM/MLIR 22 packages, the Python environment (.venv) with torch 2.15 and the CPU PJRT
# plugins (lammps-jax-pjrt-cpu, the default: a newer XLA build, measured faster; xla-cpu-pjrt,
# the fallback pip brings with tpuc), the test tools, and the build of the Rust extension.
#
#   scripts/setup.sh [--plugin NAME]...   also install an accelerator PJRT plugin from PyPI:
#       cuda (jax-cuda13-pjrt: the CUDA 13 libraries torch 2.15 brings serve it), cuda12,
#       rocm (jax-rocm7-pjrt), tpu (libtpu); or another XLA CPU build: cpu-fastatomstruct
#       (fastatomstruct-xla-cpu). libtpu is always installed (it compiles for TPU targets).
#       An accelerator is picked by options={"plugin": NAME} or by detection where its
#       hardware is present; a CPU build by its wheel's name,
#       options={"plugin": "xla-cpu-pjrt"} (docs/plugins-and-targets.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# name -> pip requirement (installed with --no-deps: none of them may touch torch).
declare -A PLUGIN_WHEELS=(
    [cuda]="jax-cuda13-pjrt==0.12.0.1"
    [cuda12]="jax-cuda12-pjrt==0.12.0.1"
    [rocm]="jax-rocm7-pjrt==0.12.0"
    [tpu]="libtpu==0.0.51"
    [cpu-lammps]="lammps-jax-pjrt-cpu==0.11.2"
    [cpu-fastatomstruct]="fastatomstruct-xla-cpu==2026.6.23"
)
# The default CPU plugin, and libtpu: it compiles for TPU slices without a TPU (options
# {"target": "tpu:v5e:2x2"}, docs/tpu-target.md) and is only loaded for that or on a TPU host.
EXTRA_PLUGINS=(cpu-lammps tpu)
while (($#)); do
    case "$1" in
    --plugin)
        [[ -n "${2:-}" && -n "${PLUGIN_WHEELS[$2]:-}" ]] || {
            echo "setup: --plugin takes one of: ${!PLUGIN_WHEELS[*]}" >&2
            exit 2
        }
        EXTRA_PLUGINS+=("$2")
        shift 2
        ;;
    *)
        echo "setup: unknown argument $1 (usage: scripts/setup.sh [--plugin NAME]...)" >&2
        exit 2
        ;;
    esac
done

# graphviz: `dot` renders the graph.svg of debugging dumps (dump_dir); without it dumps hold graph.dot.
# libdnnl2: oneDNN 2.x, which runs 2-D f32 convolutions inside compiled programs on the CPU plugin
# (hostkernels/src/host_conv.rs, loaded at run time; without it convolutions stay in XLA).
APT_PACKAGES=(llvm-22-dev libmlir-22-dev libpolly-22-dev libclang1-22 libclang-common-22-dev libzstd-dev zlib1g-dev graphviz libdnnl2)
TORCH_VERSION=2.15.0
PY=.venv/bin/python
PIP=(.venv/bin/pip install --disable-pip-version-check -q)

step() { printf '\n== %s\n' "$*"; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    step "apt: installing ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    step "apt: LLVM/MLIR 22, graphviz and oneDNN packages present"
fi

if [ ! -x "$PY" ]; then
    step "python: creating .venv"
    python3 -m venv .venv
fi

have() { "$PY" -c "$1" >/dev/null 2>&1; }
# Whether distribution $1 is installed at version $2 (a local tag such as +cpu aside), from its
# metadata: importing torch, transformers, timm or diffusers to ask takes seconds each.
installed() { have "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')"; }

if ! installed torch "$TORCH_VERSION"; then
    step "python: installing torch $TORCH_VERSION (large download, once)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi
# Plugin and verifier wheels carry no usable dependency metadata for us: --no-deps keeps pip
# from touching torch.
if ! have "import importlib.metadata as m; m.distribution('xla-cpu-pjrt')"; then
    step "python: installing the CPU PJRT plugin (xla-cpu-pjrt)"
    "${PIP[@]}" --no-deps "xla-cpu-pjrt==0.0.1"
fi
for name in "${EXTRA_PLUGINS[@]}"; do
    req=${PLUGIN_WHEELS[$name]}
    if ! have "import importlib.metadata as m, sys; sys.exit(m.version('${req%%==*}') != '${req##*==}')"; then
        step "python: installing the $name PJRT plugin ($req)"
        "${PIP[@]}" --no-deps "$req"
    fi
done
# oneDNN 3.x with GNU OpenMP (the runtime PyTorch's threads use) into .venv/lib: tpuc's host
# convolutions prefer it to Debian's 2.x (faster gradient kernels; hostkernels/src/host_conv.rs).
ONEDNN=onednn-cpu-gomp==2023.2.0
if ! have "import importlib.metadata as m, sys; sys.exit(m.version('${ONEDNN%%==*}') != '${ONEDNN##*==}')"; then
    step "python: installing oneDNN 3.x ($ONEDNN)"
    "${PIP[@]}" --no-deps "$ONEDNN"
fi
# Test tools first: the verifier wheel below needs numpy. expecttest is what PyTorch's op database
# (bench/op_sweep.py) imports; pytest-xdist runs `make test`'s pytest in two worker processes.
if ! have "import maturin, pytest, xdist, numpy, expecttest" || [ ! -x .venv/bin/ruff ]; then
    step "python: installing build and test tools"
    "${PIP[@]}" "maturin>=1.5,<2" pytest pytest-xdist numpy ruff expecttest
fi
if ! have "import matplotlib"; then
    step "python: installing matplotlib (benchmark plots)"
    "${PIP[@]}" matplotlib
fi
if ! have "import torch_mlir._mlir_libs._stablehlo"; then
    step "python: installing the StableHLO verifier (torch-mlir wheel)"
    "${PIP[@]}" --no-deps "torch-mlir==20261001"
    "${PIP[@]}" packaging
fi

# The model zoo (tests/zoo.py) builds Hugging Face and torchvision models from configs (random
# weights, no downloads). Both wheels declare torch as a dependency, so they go in with --no-deps;
# their own dependencies (none of which needs torch) are installed normally. `kernels` (hub
# kernels, an optional accelerator path) is left out: it has no release transformers accepts.
TRANSFORMERS_VERSION=5.25.0
TORCHVISION_VERSION=0.29.2 # the newest torchvision; it declares torch>=2.14
if ! installed transformers "$TRANSFORMERS_VERSION" || ! installed torchvision "$TORCHVISION_VERSION"; then
    step "python: installing transformers $TRANSFORMERS_VERSION and torchvision $TORCHVISION_VERSION (no torch)"
    "${PIP[@]}" "huggingface-hub>=2.4.0,<3" "pyyaml>=5.1" "regex>=2025.10.22" "tokenizers>=0.23.1,<0.24" \
        "safetensors>=0.8.0" "tqdm>=4.60" typer "pillow>=5.3.0,!=8.3.*" numpy packaging filelock
    "${PIP[@]}" --no-deps "transformers==$TRANSFORMERS_VERSION" "torchvision==$TORCHVISION_VERSION"
    installed torch "$TORCH_VERSION" || {
        echo "setup: installing the model zoo packages changed torch" >&2
        exit 1
    }
fi

# timm (tests/test_swinv2.py: Swin-V2's first call, issue 44) builds its models from configs
# (random weights). It declares torch and torchvision, so it goes in with --no-deps; its other
# dependencies (huggingface-hub, pyyaml, safetensors) come with Transformers above.
TIMM_VERSION=1.0.31
if ! installed timm "$TIMM_VERSION"; then
    step "python: installing timm $TIMM_VERSION (no torch)"
    "${PIP[@]}" --no-deps "timm==$TIMM_VERSION"
fi

# diffusers (bench/sweep_diffusers.py, tests/test_sweep_diffusers.py) builds its denoisers and VAEs
# from small configs. Its wheel does not declare torch, but --no-deps keeps pip from upgrading
# anything else; its own small dependencies go in normally.
DIFFUSERS_VERSION=0.42.1
if ! installed diffusers "$DIFFUSERS_VERSION"; then
    step "python: installing diffusers $DIFFUSERS_VERSION (no torch)"
    "${PIP[@]}" importlib_metadata requests "huggingface-hub>=1.32.0,<3" "safetensors>=0.8.0" regex pillow numpy filelock
    "${PIP[@]}" --no-deps "diffusers==$DIFFUSERS_VERSION"
    installed torch "$TORCH_VERSION" || {
        echo "setup: installing diffusers changed torch" >&2
        exit 1
    }
fi

step "build: Rust extension (release), installed into .venv"
.venv/bin/maturin develop --release -q -m python/Cargo.toml
"$PY" -c "import tpuc, sys; print('tpuc', tpuc.__version__, 'ready:', len(tpuc.supported_ops()), 'lowering rules')"
