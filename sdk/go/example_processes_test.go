package pal_test

// Examples of the process calls; like the others they need a Pal server, so they carry no
// "Output:" comment: `go test` compiles them but does not run them.

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	pal "github.com/pal-sandbox/pal/sdk/go"
)

func ExampleProcessesService_Output() {
	ctx := context.Background()
	client := pal.NewClient()
	procs := client.Runtime.Processes
	proc, err := procs.Start(ctx, "vm-123", pal.ProcessStart{
		Command: "/bin/sh",
		Argv:    []string{"-c", "make -j4"},
		Tag:     "build",
	})
	if err != nil {
		log.Fatal(err)
	}
	// The stream reattaches by itself from its offset across dropped connections and pauses.
	out, err := procs.Output(ctx, "vm-123", proc.ProcessID, 0)
	if err != nil {
		log.Fatal(err)
	}
	defer out.Close()
	for out.Next() {
		switch ev := out.Event(); ev.Type {
		case pal.EventStdout, pal.EventStderr:
			os.Stdout.Write(ev.Data)
		case pal.EventGap:
			log.Printf("%d bytes dropped by the journal's bound", ev.Lost)
		case pal.EventExit:
			fmt.Println("exit", ev.ExitCode)
		}
	}
	if err := out.Err(); err != nil {
		log.Fatal(err)
	}
}

func ExampleProcessesService_SendStdin() {
	ctx := context.Background()
	procs := pal.NewClient().Runtime.Processes
	proc, err := procs.Start(ctx, "vm-123", pal.ProcessStart{Command: "wc", Argv: []string{"-c"}, Stdin: true})
	if err != nil {
		log.Fatal(err)
	}
	if err := procs.SendStdin(ctx, "vm-123", proc.ProcessID, []byte{0, 1, 2, 255}); err != nil {
		log.Fatal(err)
	}
	if err := procs.CloseStdin(ctx, "vm-123", proc.ProcessID); err != nil {
		log.Fatal(err)
	}
	done, err := procs.Wait(ctx, "vm-123", proc.ProcessID, time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	read, err := procs.Read(ctx, "vm-123", proc.ProcessID, 0, 0)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(*done.ExitCode, string(read.Output[0].Data)) // 0 4
}

func ExampleProcessesService_Terminal() {
	ctx := context.Background()
	procs := pal.NewClient().Runtime.Processes
	term, err := procs.Terminal(ctx, "vm-123", pal.ProcessStart{Command: "/bin/sh"}, 80, 24)
	if err != nil {
		log.Fatal(err)
	}
	if err := term.Resize(ctx, 120, 40); err != nil {
		log.Fatal(err)
	}
	if err := term.Write(ctx, []byte("stty size; exit\n")); err != nil {
		log.Fatal(err)
	}
	out, err := term.Output(ctx, 0)
	if err != nil {
		log.Fatal(err)
	}
	defer out.Close()
	for out.Next() {
		os.Stdout.Write(out.Event().Data) // 40 120
	}
}

func ExampleProcessesService_Signal() {
	ctx := context.Background()
	procs := pal.NewClient().Runtime.Processes
	server, err := procs.Start(ctx, "vm-123", pal.ProcessStart{Command: "python3", Argv: []string{"-m", "http.server", "8000"}})
	if err != nil {
		log.Fatal(err)
	}
	// ... use it, then stop its whole process group:
	if err := procs.Signal(ctx, "vm-123", server.ProcessID, "INT"); err != nil {
		log.Fatal(err)
	}
	done, err := procs.Wait(ctx, "vm-123", server.ProcessID, 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(done.Running, done.ExitCode != nil)
}

func ExampleRuntimeService_Exec_yield() {
	ctx := context.Background()
	client := pal.NewClient()
	res, err := client.Runtime.Exec(ctx, "vm-123", pal.ExecRequest{
		Command:      "/bin/sh",
		Argv:         []string{"-c", "sleep 5; echo done"},
		YieldAfterMs: 1000,
	})
	if err != nil {
		log.Fatal(err)
	}
	if res.Running { // still running: read on from where the answer stopped
		out, err := client.Runtime.Processes.Output(ctx, "vm-123", res.ProcessID, res.Next)
		if err != nil {
			log.Fatal(err)
		}
		defer out.Close()
		for out.Next() {
			os.Stdout.Write(out.Event().Data)
		}
	}
}
