#!/usr/bin/env bash
# The W2 peers' virtual environments, for `python benchmarks/w2_ctr.py --peers` (benchmarks/README.md).
#
#     bash benchmarks/peers/setup.sh            # both peers
#     bash benchmarks/peers/setup.sh torchrec   # or one of: torchrec paddle
#
# Each peer gets its own venv under benchmarks/peers/.venvs/<peer> (git-ignored; FLEET_PEERS_VENVS
# moves it): the peers are optional, never dependencies of fleet. Idempotent: an environment that
# already imports its peer at the pinned version is left as it is.
#   TorchRec 1.8.0 + fbgemm-gpu-cpu 1.8.0 with torch 2.13.0 (CPU); the 1.9 pair does not load with torch 2.13.
#   PaddlePaddle 2.6.2 with numpy<2 and protobuf 3.20.3: the newest wheel that still has the parameter-server runtime.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENVS="${FLEET_PEERS_VENVS:-$HERE/.venvs}"
PYTHON="${PYTHON:-python3.11}"
PEERS=("$@")
[ ${#PEERS[@]} -gt 0 ] || PEERS=(torchrec paddle)

ready() {  # ready NAME CHECK-CODE: the venv exists and passes its check
    [ -x "$VENVS/$1/bin/python" ] && "$VENVS/$1/bin/python" -c "$2" >/dev/null 2>&1
}

pip_in() {  # pip_in NAME PIP-ARGS...: pip install in the peer's venv, without the noise of absent local indexes
    local name="$1"
    shift
    "$VENVS/$name/bin/pip" install -q "$@" 2>&1 | grep -v "^WARNING: Location '.*' is ignored" || true
}

for peer in "${PEERS[@]}"; do
    case "$peer" in
    torchrec)
        check='import torch, torchrec, fbgemm_gpu, torchrec.distributed
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torchrec.__version__ == "1.8.0", torchrec.__version__
assert fbgemm_gpu.__version__ == "1.8.0", fbgemm_gpu.__version__'
        if ! ready torchrec "$check"; then
            echo "torchrec: creating $VENVS/torchrec"
            "$PYTHON" -m venv "$VENVS/torchrec"
            # torchrec's metadata asks for `fbgemm-gpu` (the CUDA build, 1.9 by default), which would
            # overwrite the CPU build's files: install its other requirements (as its metadata pins them), then torchrec without them.
            pip_in torchrec torch==2.13.0 fbgemm-gpu-cpu==1.8.0 torchmetrics==1.0.3 tensordict pyre-extensions tqdm
            pip_in torchrec --no-deps torchrec==1.8.0
        fi
        "$VENVS/torchrec/bin/python" -c "$check"
        echo "torchrec: $VENVS/torchrec is ready (torchrec 1.8.0, fbgemm-gpu-cpu 1.8.0, torch 2.13.0)"
        ;;
    paddle)
        check='import paddle, numpy, google.protobuf
assert paddle.__version__ == "2.6.2", paddle.__version__
assert numpy.__version__ < "2", numpy.__version__
import paddle.distributed.fleet'
        if ! ready paddle "$check"; then
            echo "paddle: creating $VENVS/paddle"
            "$PYTHON" -m venv "$VENVS/paddle"
            pip_in paddle paddlepaddle==2.6.2 "numpy<2" protobuf==3.20.3
        fi
        "$VENVS/paddle/bin/python" -c "$check"
        echo "paddle: $VENVS/paddle is ready (paddlepaddle 2.6.2, numpy<2, protobuf 3.20.3)"
        ;;
    *)
        echo "unknown peer $peer (torchrec, paddle)" >&2
        exit 2
        ;;
    esac
done
