"""``cpshard bench``: cpshard's step against one process and its peers, measured in one run (the variants,
the config, the measuring, the report), with the peers' runners (:mod:`.baselines`, :mod:`.alst`), the
compiled step (:mod:`.compiled`) and packed rows (:mod:`.packed`)."""
