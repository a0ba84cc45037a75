"""What a suite's own pytest process loads: the plugin that records every case (``plugin``), the
run's typed context handed to it (``context``) and the lock that gives a timed case its GPU alone
(``gpu_share``). Nothing here imports the run lifecycle in ``run/``."""
