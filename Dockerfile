# One image for the agent, the coordinator and the command line: clusterwatch with
# the daemons' extras (agent, coordinator, top) and no torch (no daemon imports
# it; training images bring their own and `pip install clusterwatch` for the
# hook), plus kubectl for the coordinator's Kubernetes launcher. From the
# repository root:
#   docker build -t registry.example/clusterwatch:0.1.0 .
# deploy/kubernetes names the image by that version tag, never :latest.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# --- the wheels: clusterwatch's, and its dependencies' -----------------------
FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY clusterwatch clusterwatch
COPY agent agent
COPY coordinator coordinator
COPY tui tui
COPY dashboards dashboards
COPY deploy/prometheus/rules deploy/prometheus/rules
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[agent,coordinator,top]"

# --- kubectl, checked against its published SHA-256 -------------------------
FROM ${PYTHON_IMAGE} AS kubectl
ARG KUBECTL_VERSION=v1.30.6
ARG TARGETARCH=amd64
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ADD https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/${TARGETARCH}/kubectl /kubectl
ADD https://dl.k8s.io/release/${KUBECTL_VERSION}/bin/linux/${TARGETARCH}/kubectl.sha256 /kubectl.sha256
RUN echo "$(cat /kubectl.sha256)  /kubectl" | sha256sum --check --strict && chmod 0755 /kubectl

# --- the image ----------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG CLUSTERWATCH_VERSION=0.1.0
LABEL org.opencontainers.image.title="clusterwatch" \
      org.opencontainers.image.description="Cluster observability and fault tolerance for multi-node PyTorch training" \
      org.opencontainers.image.version="${CLUSTERWATCH_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/clusterwatch/clusterwatch"
# The user the coordinator runs as (deploy/kubernetes: runAsUser 65532); the
# agent's DaemonSet runs it as root for host access.
RUN groupadd --system --gid 65532 clusterwatch \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin clusterwatch
# Only what the wheels stage built: no compiler, no index, no cache in the image.
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels \
        "clusterwatch[agent,coordinator,top]==${CLUSTERWATCH_VERSION}"
COPY --from=kubectl /kubectl /usr/local/bin/kubectl
USER 65532:65532
ENTRYPOINT ["clusterwatch"]
CMD ["--help"]
