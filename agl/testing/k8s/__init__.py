"""A real Kubernetes API server on loopback for tests and benchmarks, and a node that runs
its Jobs.

:class:`ApiServer` runs etcd and ``miniapiserver`` (the upstream ``k8s.io/apiserver``
library serving built-in types, from the shared k8s-apiserver's ``main.go``; its binary is
``tests/k8s-apiserver/miniapiserver.xz``): real storage, watch, resourceVersions,
409/404/410 — but no controllers, no admission, no per-type validation or defaulting.
:class:`NodeSimulator` fills that gap for Jobs: it plays the Job controller and the
kubelet, running a Job's container command as a local process (or deciding an outcome) and
writing the Job's status as the real controller would.

- ``binaries``: finding etcd and miniapiserver, decompressing the latter once;
- ``process_groups``: the servers' and pods' processes, each group killed as one;
- ``api_server``: :class:`ApiServer` (etcd + miniapiserver) and ``serves`` (discovery);
- ``job_status``: Jobs as JSON, and the status the Job controller writes as one ends;
- ``node_api``: the node's Job watch and its status writer;
- ``node``: :class:`NodeSimulator`.

Nothing is imported here: each importer names the module it needs.
"""
