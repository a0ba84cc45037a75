"""What a run's folder holds and how it reads: the one results schema and the verdict
(``schema``), what a suite adds to the report (``extra``), ``report.md`` / ``summary.txt``
(``markdown``), the decode and layer tables (``decode_table``, ``layer_table``), charts
(``figures``), ``junit.xml``, ``metrics.csv`` and the fleet report of many runs (``fleet``).
Everything here renders from ``results.json``; nothing measures or runs a suite."""
