package pal_test

// These examples need a Pal server (PAL_URL, PAL_API_KEY), so they carry no "Output:"
// comment: `go test` compiles them but does not run them.

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	pal "github.com/pal-sandbox/pal/sdk/go"
)

func ExampleNewClient() {
	// PAL_URL (default http://127.0.0.1:8080) and PAL_API_KEY, unless options say otherwise.
	client := pal.NewClient(pal.WithTimeout(time.Minute))
	fmt.Println(client.URL())
}

func ExampleRuntimeService_Schedule() {
	ctx := context.Background()
	client := pal.NewClient()
	vm, err := client.Runtime.Schedule(ctx, pal.AgentSpec{
		Image:           "default",
		Limits:          &pal.Limits{MemoryMib: 512},
		Egress:          pal.EgressAllow("pypi.org", "files.pythonhosted.org"),
		IdleTimeoutSecs: 300,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Runtime.Delete(ctx, vm.VMID)
	fmt.Println(vm.VMID, vm.State)
}

func ExampleRuntimeService_Exec() {
	ctx := context.Background()
	client := pal.NewClient()
	res, err := client.Runtime.Exec(ctx, "vm-123", pal.ExecRequest{
		Command: "/bin/sh",
		Argv:    []string{"-c", "echo hello; exit 3"},
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.ExitCode, res.Stdout) // 3 hello
}

func ExampleRuntimeService_ExecStream() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel() // cancelling closes the stream, which stops the command
	client := pal.NewClient()
	stream, err := client.Runtime.ExecStream(ctx, "vm-123", pal.ExecRequest{
		Command: "/bin/sh",
		Argv:    []string{"-c", "for i in 1 2 3; do echo $i; sleep 1; done"},
	})
	if err != nil {
		log.Fatal(err) // 404, 409... before the command started
	}
	defer stream.Close()
	for stream.Next() {
		ev := stream.Event()
		if ev.Type == pal.EventExit {
			fmt.Println("exit", ev.ExitCode)
		} else {
			os.Stdout.WriteString(ev.Data) // stdout | stderr (and an error's text)
		}
	}
	if err := stream.Err(); err != nil {
		log.Fatal(err)
	}
}

func ExampleRuntimeService_PauseVM() {
	ctx := context.Background()
	client := pal.NewClient()
	paused, err := client.Runtime.PauseVM(ctx, "vm-123")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("snapshot", paused.SnapshotID)
	// A paused VM does not run commands: 409, until it is resumed.
	_, err = client.Runtime.Exec(ctx, "vm-123", pal.ExecRequest{Command: "/bin/true"})
	fmt.Println(errors.Is(err, pal.ErrConflict)) // true
	if _, err := client.Runtime.ResumeVM(ctx, "vm-123"); err != nil {
		log.Fatal(err)
	}
}

func ExampleRuntimeService_ForkVM() {
	ctx := context.Background()
	client := pal.NewClient()
	res, err := client.Runtime.ForkVM(ctx, "vm-123", 3)
	if errors.Is(err, pal.ErrQuota) {
		log.Fatal("not enough quota for 3 more VMs")
	} else if err != nil {
		log.Fatal(err)
	}
	for _, f := range res.Forks {
		if f.Error != "" {
			log.Println(f.VMID, f.Error)
		}
	}
}

func ExampleRuntimeService_ReadFile() {
	ctx := context.Background()
	client := pal.NewClient()
	if _, err := client.Runtime.WriteFile(ctx, "vm-123", "data/blob.bin", []byte{0, 1, 2, 255}); err != nil {
		log.Fatal(err)
	}
	data, err := client.Runtime.ReadFile(ctx, "vm-123", "data/blob.bin")
	if errors.Is(err, pal.ErrTruncated) {
		log.Println("only the first MiB:", len(data))
	} else if err != nil {
		log.Fatal(err)
	}
	list, err := client.Runtime.ListFiles(ctx, "vm-123", "data")
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range list.Entries {
		fmt.Println(e.Name, e.Type)
	}
}

func ExampleAPIError() {
	client := pal.NewClient()
	_, err := client.Runtime.Get(context.Background(), "vm-unknown")
	var apiErr *pal.APIError
	if errors.As(err, &apiErr) {
		fmt.Println(apiErr.Status, apiErr.Code, apiErr.Message, apiErr.RequestID)
	}
	fmt.Println(errors.Is(err, pal.ErrNotFound)) // true
}
