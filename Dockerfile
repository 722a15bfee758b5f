# syntax=docker/dockerfile:1
# The Flywheel image: every component's process, the `flywheel` command as entry point.
#   docker build -t flywheel:0.1.0-cpu .                             # CPU torch (the default)
#   docker build --build-arg VARIANT=cuda -t flywheel:0.1.0-cuda .   # CUDA torch: serving and the trainer on GPUs
# Library versions are constraints.txt's, the ones the tests last passed with; torch goes in first and alone,
# from the PyTorch CPU index for `cpu`, from PyPI (its Linux wheels bundle the CUDA libraries; the node only
# needs the NVIDIA driver) for `cuda`. The process runs as an unprivileged user with a read-only root file
# system in mind: everything it writes goes under FLYWHEEL_DATA_DIR (a volume).
# The interpreter the tests run on (3.11), at its latest security release; pin it by digest for a release build:
#   docker build --build-arg PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:... .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/flywheel/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/flywheel
COPY constraints.txt ./
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "$VARIANT" in \
      cpu)  pip install --index-url https://download.pytorch.org/whl/cpu -c constraints.txt torch ;; \
      cuda) pip install -c constraints.txt torch ;; \
      *)    echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 1 ;; \
    esac
COPY pyproject.toml README.md ./
COPY flywheel ./flywheel
COPY ingest ./ingest
COPY signals ./signals
COPY trainer ./trainer
COPY model_registry ./model_registry
COPY deploy_gate ./deploy_gate
COPY serving ./serving
COPY launcher ./launcher
COPY simulator ./simulator
# confluent: the faster Kafka client; postgres: MLflow's and the token store's database; s3: MLflow's
# artifact store (the same image runs the MLflow server).
RUN pip install -c constraints.txt ".[confluent,postgres,s3]"

FROM ${PYTHON_IMAGE}
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="flywheel" \
      org.opencontainers.image.description="Real-time online RL from user reactions (${VARIANT})"
RUN groupadd --system --gid 10001 flywheel \
    && useradd --system --uid 10001 --gid flywheel --home-dir /var/lib/flywheel --create-home flywheel
COPY --from=build /opt/flywheel /opt/flywheel
ENV PATH=/opt/flywheel/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    FLYWHEEL_DATA_DIR=/var/lib/flywheel
WORKDIR /var/lib/flywheel
USER 10001:10001
ENTRYPOINT ["flywheel"]
CMD ["--help"]
