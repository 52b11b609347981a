"""The background half of an asynchronous save: write a snapshot's rank file, then commit without collectives.

A :class:`~ucp.saving.background.job.WriteJob` (JSON: the plan, names, the state tree — never tensor
bytes) describes one rank's part of one save; :func:`~ucp.saving.background.execute.execute` carries it
out from a staging arena (:mod:`ucp.saving.staging`) that the training thread fills, following
:class:`~ucp.saving.background.image.Progress` (so with ``pipeline=True`` writing starts before the
snapshot is complete), then commits through the file handshake of :mod:`ucp.saving.background.handshake`.

One concern per module:

* :mod:`~ucp.saving.background.job` — the job and the messages about it (JSON);
* :mod:`~ucp.saving.background.image` — what a writer writes from (arena + progress, or the tensors);
* :mod:`~ucp.saving.background.handshake` — the file handshake between ranks that commits a save;
* :mod:`~ucp.saving.background.execute` — one job: write the file, take part in the commit;
* :mod:`~ucp.saving.background.thread_backend` — ``mode="thread"``: a writer thread in the training process;
* :mod:`~ucp.saving.background.process_backend` — ``mode="process"``, the training side: feeds a writer
  process over a pipe with JSON lines; the arenas are shared memory;
* :mod:`~ucp.saving.background.worker` — that writer process (``python -m ucp.saving.background.worker``).
  It keeps going when the training process dies: every job whose snapshot was complete is written
  and committed, then the process exits.
"""
