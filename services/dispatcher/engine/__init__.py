"""The dispatcher's episode engine: the episode state machine (``episodes``), the job
scheduler (``scheduler``), per-job leadership (``leader``), trajectory assembly
(``trajectories``) and the bus handlers (``handlers``)."""
