"""The ``k8s`` executor: one Kubernetes Job per rollout attempt (``controller=k8s``).

- ``config``: its settings (``K8sExecutorConfig``, ``EgressConfig``), checked as made;
- ``naming``: the label and annotation keys it owns, and each attempt's Job name;
- ``manifests``: the Job, Secret and NetworkPolicy it creates, built with no API call;
- ``job_state``: what a Job read from the API server says (its attempt, its outcome);
- ``api_errors``: which API errors are retried, and the server's message;
- ``pacing``: the token bucket that paces Job creations;
- ``executor``: ``K8sExecutor`` itself, the API calls and the watch.

Nothing is imported here: each importer names the module it needs, and importing the
package does not import the Kubernetes client (an optional extra).
"""
