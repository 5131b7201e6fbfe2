"""The elastic demo (``make demo``): one training job on three simulated nodes of this host, through a join, a
preemption with notice and a node failure, then a table of the events and their downtimes, ``loss.png`` and
``demo.json``, and the restart path's downtime for the same join.

* :mod:`~lightning_emig.demo.scenario` starts the nodes and causes the events (processes and signals);
* :mod:`~lightning_emig.demo.report` turns the records of the run into rows, a plot and JSON (pure);
* ``python -m lightning_emig.demo`` runs both, then measures the restart path
  (:mod:`lightning_emig.testing.join_downtime`, shared with ``tools/bench_elastic.py``).
"""
