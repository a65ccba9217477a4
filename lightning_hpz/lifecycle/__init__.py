"""How the processes of a run start and end: the launcher that builds DeepSpeed's ops first
(:mod:`op_build_launcher`), exit codes and coordinated exits (:mod:`run_exit`), preemption signals
(:mod:`preemption_checkpoint`), a failing rank (:mod:`rank_failure`) and a lost node or cut link
(:mod:`peer_watchdog`)."""
