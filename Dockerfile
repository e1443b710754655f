# Thaw as an AWS Lambda container-image function (CPU; Lambda has no GPU).
#
# The entrypoint speaks the Lambda Runtime API itself when AWS_LAMBDA_RUNTIME_API
# is set (on Lambda, or under `thaw emulate`), and serves HTTP on $PORT otherwise,
# so the same image also runs as a plain container. No Lambda base image or
# runtime interface client is needed.
#
# Layers go from rarely to often changed: system, torch, other dependencies,
# the package, bundles. A code change rebuilds only the last two.
#
#   docker build -t thaw .            (sam build does this from template.yaml)
#   docker build --target http -t thaw-http .   (a plain container, non-root)
#   python scripts/image.py build [--target http]   (no Docker engine, no registry: docs/containers.md)

FROM python:3.11.9-slim-bookworm AS deps

# torch is pinned, from the CPU wheel index (no CUDA libraries in a Lambda image).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Where pip finds everything else. scripts/image.py points both indexes at a
# wheelhouse on loopback; build arguments never reach the image's environment.
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    THAW_BUNDLE_SOURCE=/opt/thaw/bundles \
    THAW_CACHE_DIR=/tmp/thaw-cache \
    THAW_STATE_DIR=/tmp/thaw-state \
    THAW_JOB_STORE=sqlite:////tmp/thaw-jobs.sqlite3

WORKDIR /opt/thaw

# Dependencies before code: torch first (largest), then pyproject's dependency list.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

# The `http` target runs as this user (Lambda runs the image as a user of its own).
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin thaw

# The package is built in a stage of its own and only its installed files are
# copied out: no sources, build tree or build backend stay in the image.
FROM deps AS package
ARG PIP_INDEX_URL=https://pypi.org/simple
# The build backend once, in its own layer, so a code change rebuilds in seconds.
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))" > /tmp/build-requirements.txt \
    && pip install -r /tmp/build-requirements.txt \
    && rm /tmp/build-requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
# pip compiles the bytecode: PYTHONDONTWRITEBYTECODE and a read-only image would
# otherwise make every cold start compile Thaw from source (30-80 ms before /healthz).
RUN pip install --no-deps --no-build-isolation --root /staging .

FROM deps AS app
COPY --from=package /staging/usr/local/ /usr/local/
# The handlers are the project's (pyproject.toml's [tool.thaw] makes /opt/thaw one,
# docs/projects.md): served from the working directory, compiled here so that a
# read-only image never compiles them at a cold start.
COPY handlers/ handlers/
RUN python -m compileall -q handlers/
# Bundles last: the largest and most often replaced layer.
COPY bundles/ bundles/
ENTRYPOINT ["python", "-m", "runtime"]

# `--target http`: the image as a plain HTTP container, as an unprivileged user.
FROM app AS http
USER 10001

# The default target, and the Lambda image (template.yaml's DockerBuildTarget).
# No USER: Lambda runs every image as a user of its own whatever the image says,
# and `sam local` wraps the image in a build step that runs as the image's user
# and must write /var/rapid. CMD is what Lambda reports as the handler (_HANDLER,
# AWS_LAMBDA_FUNCTION_HANDLER under `sam local`, which needs one): the function
# the entrypoint runs there; the entrypoint itself does not read it.
FROM app AS lambda
CMD ["runtime.aws.lambda_loop.main"]
