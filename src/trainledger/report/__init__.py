"""Reports: terminal tables, JSON, plots and exports. They format ledgers; they compute nothing new."""
