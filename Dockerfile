# The one dp-fedemb image, dp-fedemb:0.1.0 (pipeline/config.py IMAGE; docs/scaling.md,
# "The image"). It is the Kubeflow component image (`dp-fedemb compile --target kubeflow`),
# the TFF worker image (worker_binary on PATH, the loopback shim of
# tff_algorithms/federated/loopback_shim.py at a fixed path) and the Beam SDK harness (Beam's boot
# entry point). The Python environment is exactly requirements/lock.txt, installed the
# README's way: `make setup` (scripts/setup_env.sh), not a second list of packages.
#
#   docker build -t dp-fedemb:0.1.0 .
ARG PYTHON_IMAGE=python:3.10.13-slim-bookworm

# Beam's SDK harness entry point (/opt/apache/beam/boot), same Beam as the lock.
FROM apache/beam_python3.10_sdk:2.59.0 AS beam

FROM ${PYTHON_IMAGE} AS build
# make runs the README's setup; a C compiler builds the loopback shim (this stage only).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/dp-fedemb
COPY . .
RUN make setup && rm -rf .cache /root/.cache
RUN mkdir -p /opt/dp-fedemb-lib \
 && cp "$(XDG_CACHE_HOME=/tmp/shim .venv/bin/python -c 'from tff_algorithms.federated import loopback_shim; print(loopback_shim.library_path())')" \
       /opt/dp-fedemb-lib/dp_fedemb_loopback_bind.so \
 && rm -rf /tmp/shim

FROM ${PYTHON_IMAGE}
# Same path as in the build stage: .venv's interpreter link and the editable install.
COPY --from=build /opt/dp-fedemb /opt/dp-fedemb
COPY --from=build /opt/dp-fedemb-lib/dp_fedemb_loopback_bind.so /usr/local/lib/dp_fedemb_loopback_bind.so
COPY --from=beam /opt/apache/beam /opt/apache/beam
ENV PATH=/opt/dp-fedemb/.venv/bin:$PATH
# worker_binary ships inside the TFF wheel; the StatefulSet runs it by name.
RUN ln -s "$(python -c 'import os, tensorflow_federated as t; print(os.path.join(os.path.dirname(t.__file__), "data", "worker_binary"))')" \
      /usr/local/bin/worker_binary \
 && test -x "$(readlink -f /usr/local/bin/worker_binary)" \
 && dp-fedemb --help >/dev/null
WORKDIR /opt/dp-fedemb
# Beam runners start the harness through the image's entry point; Kubeflow steps and the
# worker StatefulSet give their own command, which replaces it.
ENTRYPOINT ["/opt/apache/beam/boot"]
