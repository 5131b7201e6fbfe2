"""A change of world or layout, carried out at an optimizer-step boundary inside Lightning's fit loop.

Every kind of change goes the same way: decide (the membership layer, or a user's ``strategy.reconfigure``), prepare
(:mod:`.prepare` builds the next layout while the old one trains), agree and enter (:mod:`.enter`: the generation's
process group and the layout chosen for it), move (:mod:`.reconfigure` on the same processes, :mod:`.live_join`
across worlds; both through :func:`lightning_emig.migration.change.execute_change`), resume (:mod:`.boundary`:
Lightning's loop state re-expressed for the new layout; :mod:`.rebuild`: the model built again under it) and record
(:mod:`.record`, :mod:`.events`). :mod:`.incoming` holds the change a fit starts with, :mod:`.requests` the ones asked
for during a fit; :mod:`.consistency` proves the state the same before and after, :mod:`.fit_start` refuses at the
start of ``fit`` what a change could not carry.

Dependencies point one way: :mod:`lightning_emig.strategy` (Lightning's adapter) uses this package, which uses
:mod:`lightning_emig.migration`, :mod:`lightning_emig.membership`, :mod:`lightning_emig.launcher` and
:mod:`lightning_emig.layout`, and never imports the strategy: what a change needs of it, it receives through the
typed views of :mod:`.host` (a test keeps it so).
"""
