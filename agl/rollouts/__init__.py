"""``python -m agl.rollouts``: look into a gateway's rollouts (``__main__`` has the usage).

One module a job, the commands on top of the selection they share:

- ``select``: which rollouts (the selection options, ``step_of``, reading them a page at a
  time with their events);
- ``ls``: the table, from the store's summaries;
- ``text``: what models and agents wrote, as one line;
- ``calls``: an attempt's calls as the trainer reads them, and how a run's merge made
  samples of them;
- ``show``: one rollout, call by call, then its samples;
- ``export``: rollouts with their events as JSON lines;
- ``scan``: rules that flag suspicious rollouts;
- ``__main__``: the command line (options, dispatch, one-line errors).
"""
