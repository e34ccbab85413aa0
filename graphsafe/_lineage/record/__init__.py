"""Recording a load: the ops it runs (`recorder`, a dispatch mode), what leaves torch above
the dispatcher (`hooks`), and the threads it starts or cannot follow (`threads`)."""
