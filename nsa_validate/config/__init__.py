"""What a run is asked to do: the suites and their config types (``registry``), the typed profiles
and levels (``profiles``), and the routing thresholds a run suggests for a profile (``thresholds``)."""
