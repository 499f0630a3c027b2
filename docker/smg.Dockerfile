# The SMG gateway (PyPI `smg`, a Rust binary in a wheel) for docker/compose.yaml.
#
#   docker build -f docker/smg.Dockerfile -t hicache-smg:latest docker
#
# The build args are docker/Dockerfile's: BASE_IMAGE (any Debian-like image with `python3 -m venv`
# and `useradd`), PIP_CERT / PIP_FIND_LINKS (empty unless given: a build machine's CA bundle and
# local wheel folder for pip); docs/docker.md, "Without a Docker engine (buildah)".
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG SMG_VERSION=1.13.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# NOTE: a venv, not the system pip: a Debian base's python3 is "externally managed" (PEP 668)
# and refuses `pip install` outside one.
RUN python3 -m venv /opt/smg \
 && /opt/smg/bin/pip install "smg==${SMG_VERSION}" \
 && useradd --uid 2000 --create-home smg

ENV PATH=/opt/smg/bin:$PATH
USER smg
EXPOSE 30000 29000
ENTRYPOINT ["smg"]
