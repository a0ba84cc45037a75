"""What a suite's own pytest process loads: the plugin that records every case (``plugin``), the
run's typed context handed to it (``context``), the lock that gives a timed case its GPU alone
(``gpu_share``), cases taken in turn by several processes (``claim``), each Triton kernel
compiled once per run (``compile_once``) and the launches a process compiled, written down
(``launches``). Nothing here imports the run lifecycle in ``run/``."""
