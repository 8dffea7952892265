"""Running ensembles: the DAG executor (`executor`), fan-out steps (`fanout`), steps taken or skipped on
conditions (`branches`), ensembles with a decoupled step (`streaming`), and which ensembles can be served now
(`availability`, with the stages as the ensembles need them in `ensemble_stages`)."""
