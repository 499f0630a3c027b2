# The SMG gateway (PyPI `smg`, a Rust binary in a wheel) for docker/compose.yaml.
FROM python:3.12-slim
ARG SMG_VERSION=1.13.0
RUN pip install --no-cache-dir "smg==${SMG_VERSION}"
RUN useradd --uid 2000 --create-home smg
USER smg
EXPOSE 30000 29000
ENTRYPOINT ["smg"]
