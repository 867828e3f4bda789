"""What every benchmark shares: the streaming client (`client`), the traces (`traces`), the one
percentile and the repeated-run intervals (`stats`, `intervals`), the results writer
(`results`), the cluster harness (`cluster`, `baseline`) and the machine's scheduling
(`machine`, `process_cpu`)."""
