"""``LocalExecutor``: run attempts on this machine (docs/design.md, "Rollout controller").

Two kinds of harness, chosen by the harness string:

- ``module:function`` or ``python:module:function``: an ``async def function(env)``, run
  by a pool of long-lived worker processes (:mod:`agl.backends.execution.worker`), each
  running up to ``concurrency`` attempts in one asyncio loop: an attempt costs no
  interpreter start. A worker that dies has each attempt it held reported as an
  ``Exit`` and is restarted.
- ``command:<shell command>``: one process per attempt (any CLI agent), run by
  ``/bin/sh`` in its own session with the attempt's variables added to the environment;
  its stdout/stderr go to ``run_dir/attempts/<rollout_id>.<attempt>.out|.err``. A shell
  that does not exec its last command reports a signal death as exit code 128+N:
  write ``command:exec ...`` to see "killed by signal NAME".

With a ``grader`` (``module:function``, agl/grading/; command harnesses only), each
attempt runs in a workspace of its own (``run_dir/workspaces/<rollout_id>.<attempt>``,
its ``AGL_WORKSPACE`` and working folder, removed when the attempt ends) without a report
key, and the grader's verdict on that workspace, posted from here, is its reward.

``extra_pythonpath`` is prepended to ``PYTHONPATH`` for both kinds. With ``confine``, both
kinds run in their own PID and mount namespaces without capabilities, ``run_dir`` (the
gateway's store and admin token, when the gateway's folder is in it) and ``hide`` out of
sight (:mod:`agl.backends.execution.confine`). Neither kind's environment holds the
attempt's report key: a worker gets it on its launch line, a command on the pipe
``AGL_REPORT_FD`` (:mod:`agl.agent`).

Every child runs in its own process group (so a kill takes its children too) and, on
Linux, gets SIGKILL when the thread that started it (the controller's loop) dies.

The modules:

- ``config``: its settings (``LocalExecutorConfig``, with confinement) and timing constants;
- ``processes``: process-group signals and kills, exit reasons, a child's base environment;
- ``pool``: the pool of worker processes that runs Python harnesses;
- ``commands``: the process per attempt of command harnesses, their workspaces and grader;
- ``executor``: ``LocalExecutor`` itself, which picks one of the two by the harness string.

Nothing is imported here: each importer names the module it needs. The modules that log
share one logger, ``agl.backends.execution.local``, the name this package's lines always
carried.
"""
