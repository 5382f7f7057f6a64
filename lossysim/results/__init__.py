"""Results: summary.csv rows read from run directories, statistics over seeds, plots and the report.

Reads what runs wrote; imports nothing from ``lossysim.run``."""
