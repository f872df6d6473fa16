"""verl (0.9.1) as agl's training backend (``backend=verl``), one responsibility a module:

- ``config``: :class:`~.config.VerlBackendConfig` (``conf/backend/verl.yaml``), no verl;
- ``layout``: agl samples as verl's rows, plain lists (no torch, no verl);
- ``dataproto``: rows as verl's ``DataProto`` and the ``TensorDict`` hand-offs, and back;
- ``loss``: agl's exact loss on verl's ``ppo_loss`` (actor config, weighted penalties);
- ``sampling``: verl's FSDP engine scoring each token under its own sampling transform;
- ``platform``: verl on this machine (a CPU platform, the process group, its env);
- ``worker``: verl's ``TrainingWorker`` on agl's module, its lr schedule, forward passes;
- ``policy``: :class:`~.policy.VerlPolicy`, agl's ``Policy`` on verl in this process;
- ``ray``: :class:`~.ray.RayVerlPolicy`, the same on a Ray worker group of FSDP ranks.

Nothing is re-exported: importing the package imports no submodule, so no verl (the
modules import verl where they call it, ``ray`` excepted, whose worker subclasses verl's).
Inside this package ``import verl`` still names the third-party verl: imports are
absolute, and no module here is ``agl.backends.training.verl.verl``.
"""
