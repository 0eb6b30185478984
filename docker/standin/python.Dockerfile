# Stand-in for python:3.11-slim-bookworm, built by docker/base_images.sh only when no registry can be pulled from:
# Debian's python3.11 with venv and pip on the local debian:bookworm-slim stand-in, so the project's Dockerfiles
# build unchanged. The build machine's CA bundle goes in as a separate file (apt's ca-certificates package rewrites
# the standard bundle) with PIP_CERT/REQUESTS_CA_BUNDLE pointing at it: pip inside the builds trusts what the
# machine trusts (a TLS-inspecting proxy's CA, for one).
FROM debian:bookworm-slim
ARG STANDIN_HASH
LABEL ragserve.standin="${STANDIN_HASH}"
ENV LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive \
    PIP_CERT=/etc/ssl/certs/ragserve-build-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ragserve-build-ca.crt
COPY build-ca.crt /etc/ssl/certs/ragserve-build-ca.crt
# The official image runs `pip install` system-wide; Debian's PEP 668 marker would refuse it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
 && ln -s /usr/bin/python3.11 /usr/local/bin/python \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
