package sharetest

// Pid returns the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }
