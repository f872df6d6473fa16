# The coding agent's image (experiments/swe/README.md, "On Kubernetes"): agl's image, plus
# what the harness and the sandbox need, plus a task set the pipeline made, built outside
# (it downloads the projects' sdists):
#   python -m experiments.swe.pipeline make --projects parse,schema,xmltodict,voluptuous --out data/swe
#   python -m experiments.swe.pipeline filter --out data/swe
#   python -m experiments.swe.pipeline split --test 0.1 --out data/swe
#   docker build -f deploy/Dockerfile -t agl:latest .
#   docker build -f deploy/swe.Dockerfile -t agl-swe:latest .
# Untested here (no container runtime on this machine).
FROM agl:latest

# The sandbox makes namespaces and drops to nobody: root in the container, util-linux's
# unshare and setpriv (conf/swe/job.yaml grants the capabilities).
USER 0:0
RUN apt-get update && apt-get install -y --no-install-recommends util-linux \
    && rm -rf /var/lib/apt/lists/*
RUN pip install 'mini-swe-agent==2.4.6' libcst
COPY conf ./conf
COPY data/swe /data/swe
# task.options.mirror=/data/swe/mirror, task.train_files=/data/swe/3-split/train.jsonl
CMD ["python", "-m", "experiments.swe.harness"]
