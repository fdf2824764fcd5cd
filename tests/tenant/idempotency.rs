//! Findings 1 and 2: a job id runs once, counted once; a running job's records live as long as
//! it does.
