# Prefect worker image for espnet3-flows: the project installed with its tested pins, run from the
# project root so deployment entrypoints such as flows/collect_stats.py:collect_stats_flow resolve.
#   docker build -t espnet3-flows:0.1.0 .        (docker-compose.yml builds it as the `worker`, and
#   runs the same image as `dask-scheduler` / `dask-worker` with `dask scheduler` / `dask worker`)
# TORCH_INDEX_URL: the CPU build of the pinned torch (==2.9.1 accepts 2.9.1+cpu) keeps the image
# ~1.5 GB instead of ~8 GB of CUDA wheels; pass --build-arg TORCH_INDEX_URL=https://pypi.org/simple
# for the CUDA build from PyPI.
FROM python:3.11.11-slim-bookworm

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_HOME=/home/espnet/.prefect \
    OMP_NUM_THREADS=1 \
    ESPNET3_FLOWS_ROOT=/opt/espnet3-flows

WORKDIR /opt/espnet3-flows

# Dependencies first, against a stub package, so code edits do not reinstall torch.
COPY pyproject.toml constraints.txt README.md ./
RUN mkdir espnet3_flows && touch espnet3_flows/__init__.py \
    && pip install --extra-index-url "$TORCH_INDEX_URL" -c constraints.txt . \
    && pip uninstall -y espnet3-flows && rm -rf espnet3_flows build *.egg-info

COPY . .
RUN pip install --no-deps -c constraints.txt . \
    && rm -rf build *.egg-info \
    && useradd --create-home --uid 1000 espnet \
    && mkdir -p /data && chown espnet:espnet /data

USER espnet
# Prefect's worker ignores a single SIGTERM for minutes; SIGINT stops it promptly.
STOPSIGNAL SIGINT
CMD ["prefect", "worker", "start", "--pool", "espnet3", "--type", "process", "--with-healthcheck"]
