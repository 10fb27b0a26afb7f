from csvtotals.totals import column_total, read_rows
